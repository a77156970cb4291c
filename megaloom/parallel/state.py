"""A rank's piece of a full tensor, and a fresh optimizer's state to load a checkpoint into in place.

Checkpoints hold each tensor under its full shape, written piece by piece by the ranks that own them
(checkpoint/sharded.py): nothing is gathered. The gather-everything references the tests compare against are
tests/parallel/full_state.py's.
"""

from __future__ import annotations

import torch
from torch import nn

from megaloom.parallel.layout import layout_of
from megaloom.parallel.mesh import Mesh


def shard_of(full: torch.Tensor, p: nn.Parameter, mesh: Mesh) -> torch.Tensor:
    """This rank's slice of a full tensor shaped like parameter `p`'s full size."""
    return layout_of(p).shard(full, mesh.tp_rank, mesh.tp, mesh.ep_rank, mesh.ep)


def ensure_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Create a fresh optimizer's state (zeros), so that a checkpoint can be loaded into it in place. A ZeRO
    optimizer creates its state when it is built."""
    if hasattr(optimizer, "segments"):
        return
    for p in model.parameters():
        if p.requires_grad and p not in optimizer.state:
            _init_adam_state(optimizer, p)


def _init_adam_state(optimizer: torch.optim.Optimizer, p: nn.Parameter) -> None:
    on_device = optimizer.defaults.get("fused") or optimizer.defaults.get("capturable")
    optimizer.state[p] = {"step": torch.zeros((), dtype=torch.float32, device=p.device if on_device else "cpu"),
                          "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                          "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
