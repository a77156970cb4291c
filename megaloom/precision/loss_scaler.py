"""Dynamic loss scaling for fp16, with the overflow decision agreed by every rank.

fp16 gradients underflow at small magnitudes, so the loss is multiplied by `scale` before backward and the
gradients divided by it after. If any gradient anywhere (any tp shard, any pipeline stage, any replica)
holds inf/nan, every rank skips the step together and the scale halves; after `growth_interval` good steps in
a row it doubles. Written by hand rather than torch's GradScaler because the skip decision must be a
collective over all model-parallel groups, and the scaler's state must be plain numbers for checkpoints.
"""

from __future__ import annotations

import torch

from megaloom.parallel import comm
from megaloom.parallel.mesh import Mesh


class DynamicLossScaler:
    def __init__(self, init_scale: float = 2.0**16, growth_interval: int = 1000, backoff: float = 0.5,
                 growth: float = 2.0, min_scale: float = 1.0, mesh: Mesh | None = None):
        self.scale = init_scale
        self.growth_interval, self.backoff, self.growth, self.min_scale = growth_interval, backoff, growth, min_scale
        self.good_steps = 0
        self.skipped = 0
        self.mesh = mesh or Mesh.single()

    def found_overflow(self, grads: list[torch.Tensor]) -> bool:
        """True if any rank holds a non-finite gradient (one host sync per step, fp16 only)."""
        device = grads[0].device if grads else torch.device("cpu")
        bad = torch.zeros((), device=device)
        if grads:
            norms = torch._foreach_norm(grads, float("inf"))
            bad = (~torch.isfinite(torch.stack(norms))).any().float()
        for group in (self.mesh.tp_group, self.mesh.pp_group, self.mesh.dp_cp_group):
            comm.all_reduce(bad, group, op="max", recorder=self.mesh.recorder)
        return bool(bad.item())

    def update(self, overflow: bool) -> None:
        if overflow:
            self.scale = max(self.min_scale, self.scale * self.backoff)
            self.good_steps = 0
            self.skipped += 1
        else:
            self.good_steps += 1
            if self.good_steps % self.growth_interval == 0:
                self.scale *= self.growth

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped": self.skipped}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.good_steps, self.skipped = state["scale"], state["good_steps"], state["skipped"]
