"""Straggler detection (MegaScale's performance diagnosis): which rank computes slower than the others.

Each rank accumulates its compute time per step: the step's wall time minus the host time spent inside
collectives (waiting for others is not being slow). Every `resilience.straggler_every` steps the averages are
all-gathered; a rank whose compute time exceeds the median of the other ranks by
`resilience.straggler_factor` is named. On GPUs the host-side split is approximate (NCCL calls return once
enqueued); per-rank CUDA-event timers are the refinement.
"""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist

from megaloom.parallel import comm


class StragglerDetector:
    def __init__(self, world_size: int, factor: float, recorder):
        self.world_size, self.factor, self.recorder = world_size, factor, recorder
        self.compute_s, self.steps = 0.0, 0
        self._comm_mark = 0.0

    def start_step(self) -> None:
        self._comm_mark = getattr(self.recorder, "seconds", 0.0)

    def end_step(self, wall_s: float) -> None:
        comm_s = getattr(self.recorder, "seconds", 0.0) - self._comm_mark
        self.compute_s += max(0.0, wall_s - comm_s)
        self.steps += 1

    def check(self) -> tuple[list[int], list[float]]:
        """Collective over all ranks: (straggler ranks, mean compute seconds per rank); resets the window."""
        mine = torch.tensor([self.compute_s / max(self.steps, 1)], dtype=torch.float64)
        self.compute_s, self.steps = 0.0, 0
        if self.world_size == 1:
            return [], [float(mine)]
        out = torch.zeros(self.world_size, dtype=torch.float64)
        comm.all_gather_into(out, mine, dist.group.WORLD, recorder=None)
        times = out.tolist()
        slow = []
        for r, t in enumerate(times):
            median = statistics.median(times[:r] + times[r + 1:])  # the others': a world of two still has one
            if median > 0 and t > self.factor * median:
                slow.append(r)
        return slow, times
