"""Tensor names and layouts: megaloom state dicts <-> Hugging Face tensors, through the model's family.

Each family's HF mapping (``megaloom/models/<family>/hf.py``) renames (and transposes / fuses) its own tensors.
Shared by all: the head (``lm_head.weight``, or the family's ``head_name``; when tied it is not written, HF
ties it itself, and it is read from the embedding on import), RoPE's ``rotary_emb.inv_freq`` buffers some
exports contain (dropped), and the refusal, by name, of missing or unexpected tensors (`hf_common.HFTensors`).
"""

from __future__ import annotations

import torch

from megaloom.config import ModelConfig
from megaloom.convert.hf_config import hf_mapping
from megaloom.models.hf_common import HFTensors, Tensors
from megaloom.models.lora import is_adapter_name


def to_hf_names(m: ModelConfig, sd: Tensors) -> Tensors:
    """megaloom full state dict -> HF tensors (contiguous; transposed / fused where HF's layout differs)."""
    hf = hf_mapping(m)
    out = hf.to_hf_names(sd, m)
    if not m.tie_embeddings:
        out[hf.head_name] = sd["head.weight"]
    return {k: v.contiguous() for k, v in out.items()}


def from_hf_names(m: ModelConfig, tensors: Tensors, where: str) -> Tensors:
    """HF tensors -> megaloom full state dict (fp32). Missing or unexpected tensors are refused, naming them, so
    a model of another layout never loads half-way."""
    hf = hf_mapping(m)
    tensors = {k: v for k, v in tensors.items() if not k.endswith("rotary_emb.inv_freq")}
    if hf.normalize is not None:
        tensors = hf.normalize(tensors)
    reader = HFTensors(tensors, m.arch, m.n_layers, where)
    sd = hf.from_hf_names(reader, m)
    if m.tie_embeddings:
        sd["head.weight"] = sd["tok_emb.weight"]
        reader.ignore(hf.head_name)  # some exports write the tied head too; HF ignores it, and so do we
    else:
        sd["head.weight"] = reader.take(hf.head_name)
    reader.check_all_read()
    return {k: v.float().contiguous() for k, v in sd.items()}


def hf_weight_names(m: ModelConfig, sd: dict[str, torch.Tensor]) -> dict[str, str]:
    """megaloom weight name -> HF tensor name, for the tensors the family's mapping writes unchanged (renamed
    only: the very same tensor object comes out); fused or transposed ones are absent."""
    base = {k: v for k, v in sd.items() if not is_adapter_name(k)}
    by_id = {id(v): k for k, v in base.items()}
    return {by_id[id(v)]: hf for hf, v in to_hf_names(m, base).items() if id(v) in by_id}
