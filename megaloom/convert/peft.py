"""LoRA adapters between megaloom and PEFT's adapter directories: `megaloom convert --to-peft RUN_OR_CKPT OUT` writes
a run's adapters, and `megaloom convert --from-hf HF_DIR OUT_RUN --peft ADAPTER_DIR` imports a base model with a
PEFT adapter on it (`read_adapter`): the run trains that adapter on (model.lora set from adapter_config.json) or
`--to-hf` merges it.

    OUT/adapter_model.safetensors   the factors under PEFT's names, e.g. for Llama
                                    base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight  [r, in]
                                    base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight  [out, r]
    OUT/adapter_config.json         peft_type LORA, r, lora_alpha, lora_dropout, target_modules (HF's names)

`peft.PeftModel.from_pretrained(base, OUT)` then computes what the run computes, on the transformers model of its
base weights (`megaloom convert --to-hf` of a checkpoint of the base, or the HF model the run was imported from).
PEFT's scale is lora_alpha / r, as megaloom's (use_rslora false). An adapter's name is its base linear's HF name
(the family's mapping, convert/hf_names.py) with ``base_model.model.`` before it and ``.lora_A`` / ``.lora_B``
after it; a family whose HF layout fuses or transposes an adapted linear (GPT-2's c_attn) has no such name and is
refused, naming `--to-hf`, which merges the adapters into the weights instead.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from megaloom.config import ModelConfig
from megaloom.convert.errors import ConversionError
from megaloom.convert.hf import _model_config, _read_model_tensors, _refuse_existing, _resolve_checkpoint
from megaloom.convert.hf_config import DTYPES, hf_config, hf_mapping
from megaloom.convert.hf_names import to_hf_names
from megaloom.models.lora import is_adapter_name
from megaloom.models.registry import get_family

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
PREFIX = "base_model.model."  # PeftModelForCausalLM wraps the transformers model as base_model.model


def to_peft(run_or_ckpt_dir: str | Path, out_dir: str | Path, dtype: str = "float32") -> Path:
    """Write the adapters of a LoRA run's newest good checkpoint (or the given checkpoint) as a PEFT adapter
    directory. Returns out_dir."""
    if dtype not in DTYPES:
        raise ConversionError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}.")
    ckpt, run_dir, state = _resolve_checkpoint(Path(run_or_ckpt_dir))
    m = _model_config(run_dir, state, ckpt)
    if m.lora.rank <= 0:
        raise ConversionError(f"{ckpt}: trained without LoRA adapters (model.lora.rank=0), so there is no PEFT "
                              "adapter to write; export the whole model with `megaloom convert --to-hf`.")
    if m.vision_layers and not {"vision", "projector"} <= set(m.freeze):
        raise ConversionError(f"{ckpt}: besides its adapters this run trained its image encoder or projector "
                              f"(model.freeze={','.join(m.freeze) or '[]'}), which a PEFT adapter does not hold; "
                              "export the whole model with `megaloom convert --to-hf` (adapters merged).")
    hf_config(m, dtype, None)  # the base must be a transformers model: refused here as --to-hf refuses it
    sd = _read_model_tensors(ckpt, m)
    names = _hf_weight_names(m, sd)
    tensors: dict[str, torch.Tensor] = {}
    modules: set[str] = set()
    for key in sorted(k for k in sd if k.endswith(".lora_A.weight")):
        base = key[: -len(".lora_A.weight")]
        hf = names.get(f"{base}.weight")
        if hf is None:
            raise ConversionError(f"{base}: {hf_mapping(m).architecture} stores this linear fused with others or "
                                  "transposed, so a PEFT adapter has no name for it; export with `megaloom convert "
                                  "--to-hf`, which merges the adapters into the weights.")
        module = hf[: -len(".weight")]
        modules.add(module.rsplit(".", 1)[-1])
        for factor in ("lora_A", "lora_B"):
            tensors[f"{PREFIX}{module}.{factor}.weight"] = sd[f"{base}.{factor}.weight"].to(DTYPES[dtype]).contiguous()

    out = Path(out_dir)
    _refuse_existing(out, (ADAPTER_CONFIG, ADAPTER_WEIGHTS), "the PEFT output directory")
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".{ADAPTER_WEIGHTS}.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, out / ADAPTER_WEIGHTS)
    # adapter_config.json last: a directory with one is a finished adapter
    (out / ADAPTER_CONFIG).write_text(json.dumps(adapter_config(m, sorted(modules)), indent=2))
    return out


def _task_type(m: ModelConfig) -> str | None:
    """PEFT's task_type (which PeftModel subclass wraps the model; the tensor names are the same under all of
    them): CAUSAL_LM for the families trained on next-token prediction (decoders, LLaVA), SEQ_2_SEQ_LM for an
    encoder-decoder's span corruption (T5), none for a masked-LM encoder (BERT)."""
    family = get_family(m.arch)
    if family.objective is None:
        return "CAUSAL_LM"
    return "SEQ_2_SEQ_LM" if hf_mapping(m).architecture.endswith("ForConditionalGeneration") else None


def adapter_config(m: ModelConfig, target_modules: list[str]) -> dict:
    """PEFT's LoraConfig fields (the ones every PEFT release since 0.9 reads) for ``m``'s adapters."""
    return {"peft_type": "LORA", "task_type": _task_type(m), "r": m.lora.rank,
            "lora_alpha": m.lora.alpha,
            "lora_dropout": m.lora.dropout, "target_modules": target_modules, "bias": "none",
            "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "init_lora_weights": True,
            "modules_to_save": None, "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {},
            "alpha_pattern": {}, "base_model_name_or_path": None, "revision": None, "inference_mode": True}


def _hf_weight_names(m: ModelConfig, sd: dict[str, torch.Tensor]) -> dict[str, str]:
    """megaloom weight name -> HF tensor name, for the tensors the family's mapping writes unchanged (renamed
    only: the very same tensor object comes out); fused or transposed ones are absent."""
    base = {k: v for k, v in sd.items() if not is_adapter_name(k)}
    by_id = {id(v): k for k, v in base.items()}
    return {by_id[id(v)]: hf for hf, v in to_hf_names(m, base).items() if id(v) in by_id}


# ------------------------------------------------------------------------------------------------------ import
# PEFT LoraConfig fields whose non-default values compute something megaloom's adapters do not (each refused)
_SUPPORTED = {"use_rslora": (False, None), "use_dora": (False, None), "fan_in_fan_out": (False, None),
              "bias": ("none", None), "modules_to_save": (None, []), "layers_to_transform": (None, []),
              "rank_pattern": ({}, None), "alpha_pattern": ({}, None)}


def read_adapter(adapter_dir: str | Path, m: ModelConfig, base: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    """A PEFT LoRA adapter directory as (model.lora settings, megaloom adapter tensors) for the model ``m`` whose
    base weights ``base`` (megaloom names) it was trained on. Refused, naming the field, where PEFT would compute
    something megaloom's adapters do not (rsLoRA, DoRA, per-layer ranks, trained biases or extra modules), or where
    an adapter sits on a linear the family's HF layout fuses (no megaloom adapter has its shape)."""
    from safetensors.torch import load_file

    src = Path(adapter_dir)
    if not (src / ADAPTER_CONFIG).is_file() or not (src / ADAPTER_WEIGHTS).is_file():
        raise ConversionError(f"--peft {src}: not a PEFT adapter directory (it needs {ADAPTER_CONFIG} and "
                              f"{ADAPTER_WEIGHTS}, as peft's save_pretrained writes them).")
    try:
        pc = json.loads((src / ADAPTER_CONFIG).read_text())
    except json.JSONDecodeError as e:
        raise ConversionError(f"{src / ADAPTER_CONFIG}: not valid JSON ({e}).") from e
    if pc.get("peft_type") != "LORA":
        raise ConversionError(f"{src / ADAPTER_CONFIG}: peft_type {pc.get('peft_type')!r}; only LORA adapters "
                              "import.")
    for key, allowed in _SUPPORTED.items():
        if pc.get(key) not in allowed:
            raise ConversionError(f"{src / ADAPTER_CONFIG}: {key}={pc[key]!r} is not supported by megaloom's LoRA "
                                  f"(it computes y = W x + (alpha / r) B A x on whole linears); merge the adapter into "
                                  "the base with peft's merge_and_unload() and import that with --from-hf alone.")
    names = {hf: ours for ours, hf in _hf_weight_names(m, base).items()}
    adapters: dict[str, torch.Tensor] = {}
    targets: set[str] = set()
    for key, t in load_file(str(src / ADAPTER_WEIGHTS)).items():
        module, factor = _split_adapter_key(key, src)
        ours = names.get(f"{module}.weight")
        if ours is None:
            raise ConversionError(f"{src / ADAPTER_WEIGHTS}: {key} adapts {module}, which {m.arch}'s megaloom model "
                                  "has no separate linear for (fused or transposed in megaloom's HF mapping, or "
                                  "not a linear of the blocks); merge it with peft's merge_and_unload() instead.")
        adapters[f"{ours[: -len('.weight')]}.{factor}.weight"] = t.float()
        targets.add(ours[: -len(".weight")].rsplit(".", 1)[-1])
    r = int(pc["r"])
    lora = {"rank": r, "alpha": float(pc.get("lora_alpha", r)), "targets": sorted(targets),
            "dropout": float(pc.get("lora_dropout", 0.0))}
    return lora, adapters


def _split_adapter_key(key: str, src: Path) -> tuple[str, str]:
    """``base_model.model.<HF module>.lora_A.weight`` -> (HF module, "lora_A"); an adapter name PEFT may keep
    between them (``.lora_A.default.weight``) is dropped."""
    parts = key.split(".")
    if not key.startswith(PREFIX) or parts[-1] != "weight" or not {"lora_A", "lora_B"} & set(parts):
        raise ConversionError(f"{src / ADAPTER_WEIGHTS}: unexpected tensor {key!r} (a LoRA adapter file holds "
                              f"{PREFIX}<module>.lora_A.weight and .lora_B.weight only).")
    i = max(i for i, p in enumerate(parts) if p in ("lora_A", "lora_B"))
    return ".".join(parts[:i])[len(PREFIX):], parts[i]
