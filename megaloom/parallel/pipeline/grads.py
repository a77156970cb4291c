"""Gradient completion and clipping with pipeline stages.

`GradientSync` already reduces over tp and dp and measures the norm over tp and pp (`tp_grad_norm` sums the
stages' squares over the pipeline group). Two things are pipeline-specific: the tied embedding's gradient is
summed over the first and last stage first (`sync_tied_grads`), and the norm must count that weight once,
although after the sum both stages hold it. The last stage's copy is laid out as a ``tied_copy`` and left out
of the sum of squares here; everything else is counted as `tp_grad_norm` counts it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from megaloom.parallel import comm
from megaloom.parallel.expert import expert_norm_sq, is_expert_param
from megaloom.parallel.grads import GradientSync, scale_to_norm
from megaloom.parallel.layout import layout_of
from megaloom.parallel.mesh import Mesh
from megaloom.parallel.pipeline.stage import PipelineStage, sync_tied_grads


def pipeline_grad_norm(model: nn.Module, mesh: Mesh) -> torch.Tensor:
    """L2 norm of the full model's gradient from this stage's (tp-sharded) gradients: each element once."""
    device = next(model.parameters()).device
    total = torch.zeros((), dtype=torch.float32, device=device)
    experts = []
    for p in model.parameters():
        if p.grad is None or layout_of(p).tied_copy:
            continue
        if is_expert_param(p):
            experts.append((p.grad, p))
            continue
        sq = p.grad.float().pow(2).sum()
        # Replicated over tp: every tp rank holds it, count 1/tp on each; a replicated KV head 1/replicas.
        total += sq * layout_of(p).norm_weight(mesh.tp)
    if mesh.ep > 1:
        total += expert_norm_sq(experts, mesh).to(device)
    comm.all_reduce(total, mesh.tp_group, recorder=mesh.recorder)
    comm.all_reduce(total, mesh.pp_group, recorder=mesh.recorder)
    return total.sqrt()


class PipelineGradientSync(GradientSync):
    """`GradientSync` for a pipeline stage: tied-embedding sum, then tp/dp completion; norm without the copy."""

    def __init__(self, stage: PipelineStage, mesh: Mesh, embedding_group: Any = None) -> None:
        super().__init__(stage.model, mesh)
        self.stage, self.embedding_group = stage, embedding_group

    def finish(self) -> None:
        sync_tied_grads(self.stage, self.embedding_group, self.mesh)
        super().finish()

    def clip(self, max_norm: float) -> torch.Tensor:
        if self.mesh.pp == 1:
            return super().clip(max_norm)
        return scale_to_norm(self.params, pipeline_grad_norm(self.model, self.mesh), max_norm)
