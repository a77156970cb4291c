"""A LoRA run's adapters as a PEFT adapter directory: `megaloom convert --to-peft RUN_OR_CKPT OUT` (the other way,
`--from-hf HF_DIR OUT_RUN --peft ADAPTER_DIR`, is convert/peft_format.py's `read_adapter`).

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
from megaloom.convert.hf_names import hf_weight_names
from megaloom.convert.peft_format import ADAPTER_CONFIG, ADAPTER_WEIGHTS, PREFIX
from megaloom.models.registry import get_family


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
    if get_family(m.arch).reads_images(m) and not {"vision", "projector"} <= set(m.freeze):
        raise ConversionError(f"{ckpt}: besides its adapters this run trained its image encoder or projector "
                              f"(model.freeze={','.join(m.freeze) or '[]'}), which a PEFT adapter does not hold; "
                              "export the whole model with `megaloom convert --to-hf` (adapters merged).")
    hf_config(m, dtype, None)  # the base must be a transformers model: refused here as --to-hf refuses it
    sd = _read_model_tensors(ckpt, m)
    names = hf_weight_names(m, sd)
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
