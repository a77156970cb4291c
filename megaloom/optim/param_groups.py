"""Megatron's weight-decay rule as optimizer parameter groups, shared by every optimizer megaloom builds.

Its own module, below both `megaloom.optim` (the optimizer factory, which builds AdamW or LAMB) and
`megaloom.optim.lamb` (which builds its groups the same way): the rule lived in optim.py, so lamb.py imported the
factory that imports it, an import circle (issue 37).
"""

from __future__ import annotations

from torch import nn


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Megatron's rule: no weight decay on biases and norm weights (1-D tensors); decay everything else."""
    decay, no_decay, seen = [], [], set()
    for _, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (decay if p.ndim >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
