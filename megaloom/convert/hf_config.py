"""Model settings: megaloom's `model.*` <-> Hugging Face config.json, through the model's family.

Each family's HF mapping (``megaloom/models/<family>/hf.py``) spells its own config.json fields and refuses,
with the field's name, anything HF can express that megaloom's model would compute differently (never
silently dropped: a converted model must produce the same logits). Here: the lookup (by ``model.arch`` on
export, by config.json's ``model_type`` on import), the fields every causal LM shares, and the checks that
hold for every family.
"""

from __future__ import annotations

import torch

from megaloom.config import ModelConfig
from megaloom.convert.errors import ConversionError
from megaloom.models.family import Family, HFMapping
from megaloom.models.registry import FAMILIES, get_family

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _converting() -> list[Family]:
    return [f for f in FAMILIES.values() if f.hf is not None]


def _mappings() -> list[HFMapping]:
    """Every HF mapping megaloom has: each family's, and its MoE and latent-attention models' where it has them."""
    return [h for f in _converting() for h in (f.hf, f.hf.moe, f.hf.mla) if h is not None]


def hf_mapping(m: ModelConfig) -> HFMapping:
    """The HF mapping of ``m``'s family (its latent-attention mapping for model.attention=mla, its MoE mapping for
    an MoE model, if it has them); a ConversionError if it has none."""
    family = get_family(m.arch)
    if family.hf is None:
        raise ConversionError(f"model.arch={m.arch!r} has no Hugging Face conversion (no megaloom/models/{m.arch}/"
                              f"hf.py); {', '.join(f.name for f in _converting())} do.")
    if getattr(m, "attention", "gqa") == "mla":
        if family.hf.mla is None:
            raise ConversionError(f"model.attention=mla: model.arch={m.arch!r} has no Hugging Face class with latent "
                                  "attention (HFMapping.mla). Only model.attention=gqa models of this family can be "
                                  "exported.")
        return family.hf.mla
    if m.moe_every and family.hf.moe is not None:
        return family.hf.moe
    return family.hf


def check_exportable(m: ModelConfig) -> HFMapping:
    """Refuse, naming the setting, what no HF class megaloom writes can express; returns the family's mapping."""
    hf = hf_mapping(m)
    if m.parallel_block:
        raise ConversionError(f"model.parallel_block=true: Hugging Face's {hf.architecture} has no parallel block, "
                              "so the exported model would compute something else. Only models trained with "
                              "model.parallel_block=false can be exported.")
    if m.sliding_window and not hf.sliding_window:
        raise ConversionError(f"model.sliding_window={m.sliding_window}: Hugging Face's {hf.architecture} attends "
                              "to the full context. Only models trained with model.sliding_window=0 can be exported.")
    if m.moe_every and hf is get_family(m.arch).hf:  # neither an MoE nor a latent-attention mapping took it
        raise ConversionError(f"model.moe_every={m.moe_every}: megaloom's Mixture-of-Experts layers have no Hugging "
                              f"Face mapping ({hf.architecture} is a dense model). Only dense models "
                              "(model.moe_every=0) can be exported.")
    return hf


def hf_config(m: ModelConfig, dtype: str, eos_id: int | None = None) -> dict:
    """config.json for a megaloom model shape (resolved: n_kv_heads and ffn_dim may be 0 = default)."""
    hf = check_exportable(m)
    common = {"vocab_size": m.vocab_size, "tie_word_embeddings": m.tie_embeddings, "initializer_range": m.init_std,
              # transformers <4.56 reads torch_dtype, newer versions dtype
              "torch_dtype": dtype, "dtype": dtype, "use_cache": True}
    if eos_id is not None:
        common.update(bos_token_id=eos_id, eos_token_id=eos_id)
    return {"architectures": [hf.architecture], "model_type": hf.model_types[0], **hf.to_hf_config(m), **common}


def mapping_of_model_type(hf: dict, where: str) -> HFMapping:
    """The HF mapping that reads config.json's ``model_type``; a ConversionError lists those megaloom reads."""
    kind = hf.get("model_type")
    for mapping in _mappings():
        if kind in mapping.model_types:
            return mapping
    known = [f"{t!r} ({h.architecture})" for h in _mappings() for t in h.model_types]
    readable = known[0] if len(known) == 1 else ", ".join(known[:-1]) + " and " + known[-1]
    raise ConversionError(f"{where}: model_type={kind!r} (architectures {hf.get('architectures') or []}) cannot be "
                          f"imported; megaloom reads model_type {readable}.")


def model_settings(hf: dict, where: str) -> dict:
    """megaloom model.* values (resolved, dropout 0, full attention) for an HF config.json."""
    mapping = mapping_of_model_type(hf, where)
    try:
        out = mapping.from_hf_config(hf, where)
    except KeyError as e:
        raise ConversionError(f"{where}: required field {e.args[0]!r} is missing for model_type "
                              f"{hf.get('model_type')!r}.") from e
    out.update(dropout=0.0, parallel_block=False)
    out.setdefault("sliding_window", 0)  # full attention, unless the family's mapping read a window
    return out
