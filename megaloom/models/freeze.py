"""model.freeze: parts of a model trained frozen (LLaVA's stage 1 trains the projector alone).

A frozen parameter gets ``requires_grad=False`` before the data-parallel wrappers and the optimizer are built, so
autograd computes no gradient for it, the gradient buckets (plain, ZeRO-1/2) and FSDP2 leave it out, and the
optimizer holds no state for it: all of them collect only parameters that require gradients. Called on the
parallelised (meta) model before it is materialised; `to_empty` keeps the flag.
"""

from __future__ import annotations

from torch import nn

from megaloom.config import ConfigError


def model_parts(model: nn.Module) -> dict[str, list[nn.Parameter]]:
    """The parameters of each part model.freeze may name: a multimodal model's own split, a text model's one part
    ("language")."""
    parts = getattr(model, "part_params", None)
    return parts() if parts is not None else {"language": list(model.parameters())}


def freeze_parts(model: nn.Module, names: list[str]) -> int:
    """Freeze the named parts; returns how many parameters (elements) are frozen."""
    if not names:
        return 0
    parts = model_parts(model)
    frozen = 0
    for name in names:
        if name not in parts:
            raise ConfigError(f"model.freeze: this model has no part {name!r}; its parts are {', '.join(parts)}.")
        for p in parts[name]:
            p.requires_grad_(False)
            frozen += p.numel()
    if not any(p.requires_grad for p in model.parameters()):
        raise ConfigError(f"model.freeze={','.join(names)} freezes every parameter: nothing would train.")
    return frozen
