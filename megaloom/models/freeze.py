"""model.freeze: parts of a model trained frozen (LLaVA's stage 1 trains the projector alone).

A frozen parameter gets ``requires_grad=False`` before the data-parallel wrappers and the optimizer are built, so
autograd computes no gradient for it, the gradient buckets (plain, ZeRO-1/2) and FSDP2 leave it out, and the
optimizer holds no state for it: all of them collect only parameters that require gradients. Called on the
parallelised (meta) model before it is materialised; `to_empty` keeps the flag. LoRA (model.lora) freezes the
language model the same way, keeping only its adapters trainable (`freeze_for_training`).
"""

from __future__ import annotations

from torch import nn

from megaloom.config import ConfigError, ModelConfig


def model_parts(model: nn.Module) -> dict[str, list[nn.Parameter]]:
    """The parameters of each part model.freeze may name: a multimodal model's own split, a text model's one part
    ("language")."""
    parts = getattr(model, "part_params", None)
    return parts() if parts is not None else {"language": list(model.parameters())}


def freeze_parts(model: nn.Module, names: list[str], keep: set[int] | None = None) -> int:
    """Freeze the named parts, except the parameters whose id is in ``keep``; returns how many parameters
    (elements) are frozen."""
    if not names:
        return 0
    parts = model_parts(model)
    keep = keep or set()
    frozen = 0
    for name in names:
        if name not in parts:
            raise ConfigError(f"model.freeze: this model has no part {name!r}; its parts are {', '.join(parts)}.")
        for p in parts[name]:
            if id(p) in keep:
                continue
            p.requires_grad_(False)
            frozen += p.numel()
    if not any(p.requires_grad for p in model.parameters()):
        raise ConfigError(f"model.freeze={','.join(names)} freezes every parameter: nothing would train.")
    return frozen


def freeze_for_training(model: nn.Module, cfg: ModelConfig) -> int:
    """What trains frozen: the parts model.freeze names and, with LoRA (model.lora.rank > 0), the whole language
    model but its adapters (models/lora.py); the other parts of a multimodal model follow model.freeze."""
    names = list(cfg.freeze)
    keep: set[int] = set()
    if cfg.lora.rank > 0:
        from megaloom.models.lora import adapter_params

        names += [] if "language" in names else ["language"]
        keep = {id(p) for p in adapter_params(model)}
    return freeze_parts(model, names, keep)
