"""PEFT's adapter directory format, and reading one: `megaloom convert --from-hf HF_DIR OUT_RUN --peft ADAPTER_DIR`
imports a base model with a PEFT LoRA adapter on it (`read_adapter`); the run then trains that adapter on
(model.lora set from adapter_config.json), or `--to-hf` merges it. Writing one is convert/peft.py (`--to-peft`).

    ADAPTER_DIR/adapter_model.safetensors   the factors under PEFT's names, e.g. for Llama
                                            base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight  [r, in]
    ADAPTER_DIR/adapter_config.json         peft_type LORA, r, lora_alpha, lora_dropout, target_modules
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from megaloom.config import ModelConfig
from megaloom.convert.errors import ConversionError
from megaloom.convert.hf_names import hf_weight_names

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
PREFIX = "base_model.model."  # PeftModelForCausalLM wraps the transformers model as base_model.model


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
    names = {hf: ours for ours, hf in hf_weight_names(m, base).items()}
    adapters: dict[str, torch.Tensor] = {}
    targets: set[str] = set()
    for key, t in load_file(str(src / ADAPTER_WEIGHTS)).items():
        module, factor = _split_adapter_key(key, src)
        ours = names.get(f"{module}.weight")
        if ours is None:
            raise ConversionError(f"{src / ADAPTER_WEIGHTS}: {key} adapts {module}, which {m.arch}'s megaloom model "
                                  "has no separate linear for (fused or transposed in megaloom's HF mapping, or "
                                  "not a linear of the blocks); merge it with peft's merge_and_unload() instead.")
        linear = ours.removesuffix(".weight")
        adapters[f"{linear}.{factor}.weight"] = t.float()
        targets.add(linear.rsplit(".", 1)[-1])
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
