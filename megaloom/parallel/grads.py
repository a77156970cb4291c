"""After backward: complete the gradients over every group, then measure and clip their global norm.

Order per step: tensor-parallel fix-ups (sequence-parallel norms, replicated KV heads) -> data-parallel
average -> global norm (each element of the full model counted once) -> clip. On one process all of this is
`clip_grad_norm_`. The data-parallel reduction here is one flat all-reduce per dtype after the last
micro-batch; overlapping it with backward in buckets and sharding it (ZeRO) is the data-parallel layer's job.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from megaloom.parallel import comm
from megaloom.parallel.expert import is_expert_param
from megaloom.parallel.grad_norm import DeviceConstants, global_grad_norm
from megaloom.parallel.mesh import Mesh
from megaloom.parallel.tensor import sync_tp_grads


class GradientSync:
    def __init__(self, model: nn.Module, mesh: Mesh):
        self.model, self.mesh = model, mesh
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.constants = DeviceConstants()  # the norm's per-tensor weights, on the device once

    def finish(self) -> None:
        """Make each rank's gradients the full-batch gradients of the parameters it holds."""
        if self.mesh.tp > 1:
            sync_tp_grads(self.model, self.mesh)
        n = self.mesh.dp * self.mesh.cp
        if n > 1:
            # Expert weights live on the edp ranks only (each ep rank owns others); every gradient is divided
            # by the full data-parallel size, because each one sums contributions of all dp ranks' tokens.
            for p in self.params:  # local experts that got no token this step: their peers may have some
                if p.grad is None and is_expert_param(p):
                    p.grad = torch.zeros_like(p)
            grads = [p for p in self.params if p.grad is not None]
            _average([p.grad for p in grads if not is_expert_param(p)], self.mesh.dp_cp_group, n, self.mesh)
            experts = [p.grad for p in grads if is_expert_param(p)]
            if experts:
                _average(experts, self.mesh.edp_group, n, self.mesh)

    def clip(self, max_norm: float) -> torch.Tensor:
        """Global L2 norm of the gradient before clipping; scales gradients in place if it exceeds max_norm."""
        if self.mesh.tp == 1 and self.mesh.pp == 1 and self.mesh.ep == 1:
            return torch.nn.utils.clip_grad_norm_(self.params, max_norm, foreach=True)
        return scale_to_norm(self.params, global_grad_norm(self.params, self.mesh, constants=self.constants),
                             max_norm)


def _average(grads: list[torch.Tensor], group, n: int, mesh: Mesh) -> None:
    """Sum over ``group`` and divide by ``n``: one flat all-reduce per dtype, written back in place."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for same in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in same])
        comm.all_reduce(flat, group, recorder=mesh.recorder)
        flat.div_(n)
        for g, part in zip(same, flat.split([g.numel() for g in same]), strict=True):
            g.copy_(part.view_as(g))


def scale_to_norm(params: list[torch.Tensor], total: torch.Tensor, max_norm: float) -> torch.Tensor:
    """Scale gradients in place so that a global norm `total` becomes at most `max_norm`; returns `total`.
    The coefficient stays on the device (no host sync)."""
    if math.isfinite(max_norm):
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        grads = [p.grad for p in params if p.grad is not None]
        torch._foreach_mul_(grads, coef)
    return total
