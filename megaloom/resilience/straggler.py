"""Straggler detection (MegaScale's performance diagnosis): which rank computes slower than the others.

Each rank accumulates its compute time per step: the step's wall time minus the host time spent inside
collectives (waiting for others is not being slow). Every `resilience.straggler_every` steps the averages are
all-gathered once over the run's host-side (gloo) control group, never over the training groups: on GPUs those
are NCCL groups, which have no CPU backend. A rank whose compute time exceeds the median of the other ranks by
`resilience.straggler_factor` is named. The medians of all ranks come from one sort (`medians_of_others`):
O(world log world), 8,192 ranks in about a millisecond. On GPUs the host-side split is approximate (NCCL calls
return once enqueued); per-rank CUDA-event timers are the refinement.
"""

from __future__ import annotations

import numpy as np

from megaloom.parallel.host_group import HostGroup


def medians_of_others(values: np.ndarray, include: np.ndarray | None = None) -> np.ndarray:
    """For every rank r, the median of ``values[j]`` over the included ranks j != r (0.0 where there are none).

    ``statistics.median`` semantics (the mean of the two middle values for an even count). One sort of the
    included values; rank r's median is read from that sorted array as if r's own entry were removed, by index
    arithmetic, so all ranks together cost O(n log n) instead of n sorts of n - 1 values.
    """
    values = np.asarray(values, dtype=np.float64)
    n = values.shape[0]
    include = np.ones(n, dtype=bool) if include is None else np.asarray(include, dtype=bool)
    order = np.argsort(values[include], kind="stable")
    kept = values[include][order]  # the included values, sorted
    h = kept.shape[0]
    removed = np.full(n, h, dtype=np.int64)  # sorted position of r's own entry; h (past the end) = not removed
    removed[np.flatnonzero(include)[order]] = np.arange(h)
    m = h - include.astype(np.int64)  # how many "others" each rank has
    lo, hi = (m - 1) // 2, m // 2  # the middle positions among the others (lo == hi when m is odd)

    def at(k: np.ndarray) -> np.ndarray:  # the k-th smallest of the others: skip over r's own entry
        idx = k + (k >= removed)
        return kept[np.clip(idx, 0, max(h - 1, 0))] if h else np.zeros(n)

    return np.where(m > 0, (at(lo) + at(hi)) / 2, 0.0)


def slower_than_others(values: np.ndarray, factor: float, include: np.ndarray | None = None) -> np.ndarray:
    """Per rank: is it more than ``factor`` x the median of the other (included) ranks?"""
    med = medians_of_others(values, include)
    return (med > 0) & (np.asarray(values, dtype=np.float64) > factor * med)


class StragglerDetector:
    def __init__(self, world_size: int, factor: float, recorder, group: HostGroup | None = None):
        """``group``: the run's host-side control group (None: one process, nothing to gather)."""
        self.world_size, self.factor, self.recorder, self.group = world_size, factor, recorder, group
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
        mine = self.compute_s / max(self.steps, 1)
        self.compute_s, self.steps = 0.0, 0
        if self.group is None:
            return [], [mine]
        times = self.group.all_gather_floats([mine])[:, 0].numpy()
        return np.flatnonzero(slower_than_others(times, self.factor)).tolist(), times.tolist()
