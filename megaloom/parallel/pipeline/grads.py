"""Gradient completion and clipping with pipeline stages.

`GradientSync` already reduces over tp and dp and measures the norm over tp and pp (`global_grad_norm` sums the
stages' squares over the pipeline group). One thing is pipeline-specific: the tied embedding's gradient is
summed over the first and last stage first (`sync_tied_grads`). The norm must count that weight once, although
after the sum both stages hold it: the last stage's copy is laid out as a ``tied_copy``, which the norm's one
rule leaves out (parallel/grad_norm.py).
"""

from __future__ import annotations

from typing import Any

from megaloom.parallel.grads import GradientSync
from megaloom.parallel.mesh import Mesh
from megaloom.parallel.pipeline.stage import PipelineStage, sync_tied_grads


class PipelineGradientSync(GradientSync):
    """`GradientSync` for a pipeline stage: tied-embedding sum, then tp/dp completion; norm without the copy."""

    def __init__(self, stage: PipelineStage, mesh: Mesh, embedding_group: Any = None) -> None:
        super().__init__(stage.model, mesh)
        self.stage, self.embedding_group = stage, embedding_group

    def finish(self) -> None:
        sync_tied_grads(self.stage, self.embedding_group, self.mesh)
        super().finish()
