"""Straggler detection (MegaScale's performance diagnosis): which rank computes slower than the others.

Each rank accumulates its compute time per step, waiting for others excluded (that is communication, not being
slow):

- on CPU: the step's wall time minus the host time spent inside collectives (gloo blocks the host until done);
- on a GPU: the host cannot tell (NCCL calls return once enqueued, so the wait lands in the next host sync and
  every rank looks equally slow). `DeviceSpans` records the device's timing events (CUDA's on a GPU) on the
  compute stream at the step's start and end and around every collective (`comm`'s recorder: the stream waits for
  the collective there, peers included), never waiting for them; a step's device compute is its span minus those
  collective spans. The events are read once they have completed (`Event.query`, no sync) or, for the last steps,
  when the report is due.

Every `resilience.straggler_every` steps the averages are all-gathered once over the run's host-side (gloo)
control group, never over the training groups: on GPUs those are NCCL groups, which have no CPU backend. A rank
whose compute time exceeds the median of the other ranks by `resilience.straggler_factor` is named. The medians of
all ranks come from one sort (`medians_of_others`): O(world log world), 8,192 ranks in about a millisecond.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from megaloom import accelerator
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


class DeviceSpans:
    """Per-step device compute from events on the current stream: the step's span minus its collectives' spans.

    ``event``: makes an event with ``record()``, ``query()``, ``synchronize()`` and ``elapsed_time(later)`` in
    milliseconds (a timing event of the device's, `for_device`; the CPU tests pass a simulated clock). Nothing here
    waits for the device except `take`, when the report is due."""

    def __init__(self, event: Callable[[], Any]) -> None:
        self.event = event
        self._start: Any = None
        self._open: Any = None
        self._comm: list[tuple[Any, Any]] = []
        self._pending: list[tuple[Any, Any, list[tuple[Any, Any]]]] = []  # steps whose events are not read yet
        self.seconds, self.steps = 0.0, 0

    def _now(self) -> Any:
        e = self.event()
        e.record()
        return e

    def start(self) -> None:
        self._start, self._open, self._comm = self._now(), None, []

    def comm_enter(self) -> None:
        # Collectives outside a step (evaluation, checkpoints) are not counted, nor those traced into a compiled
        # block (train.compile), where no event can be recorded: their waits count as compute (a slow rank then
        # makes its tp peers look slow with it, which still names the group).
        if self._start is not None and not torch.compiler.is_compiling():
            self._open = self._now()

    def comm_exit(self) -> None:
        if self._open is not None:
            self._comm.append((self._open, self._now()))
            self._open = None

    def end(self) -> None:
        if self._start is None:
            return
        self._pending.append((self._start, self._now(), self._comm))
        self._start, self._open, self._comm = None, None, []
        self._fold(wait=False)

    def _fold(self, wait: bool) -> None:
        while self._pending:
            start, end, comm = self._pending[0]
            if wait:
                end.synchronize()
            elif not end.query():  # later steps end later on the stream: stop at the first unfinished one
                return
            ms = start.elapsed_time(end) - sum(a.elapsed_time(b) for a, b in comm)
            self.seconds += max(0.0, ms) / 1e3
            self.steps += 1
            self._pending.pop(0)

    def take(self) -> tuple[float, int]:
        """(device compute seconds, steps) since the last take: waits for the steps still on the device."""
        self._fold(wait=True)
        out = (self.seconds, self.steps)
        self.seconds, self.steps = 0.0, 0
        return out


class StragglerDetector:
    def __init__(self, world_size: int, factor: float, recorder, group: HostGroup | None = None,
                 spans: DeviceSpans | None = None):
        """``group``: the run's host-side control group (None: one process, nothing to gather). ``spans``: device
        timing (`DeviceSpans`; what a run on an accelerator uses, see `for_device`), told by ``recorder`` (a
        `comm.LastOpRecorder`) about every collective; None: host timing."""
        self.world_size, self.factor, self.recorder, self.group = world_size, factor, recorder, group
        self.spans = spans
        if spans is not None:
            recorder.spans = spans
        self.compute_s, self.steps = 0.0, 0
        self._comm_mark = 0.0

    @classmethod
    def for_device(cls, device: torch.device, world_size: int, factor: float, recorder,
                   group: HostGroup | None = None) -> StragglerDetector:
        """Device timing on an accelerator with events (its timing events, looked up once), host timing elsewhere."""
        streams = accelerator.streams(device)
        spans = DeviceSpans(functools.partial(streams.event_class, enable_timing=True)) if streams is not None else None
        return cls(world_size, factor, recorder, group, spans)

    def start_step(self) -> None:
        self._comm_mark = getattr(self.recorder, "seconds", 0.0)
        if self.spans is not None:
            self.spans.start()

    def end_step(self, wall_s: float) -> None:
        if self.spans is not None:
            self.spans.end()
            return
        comm_s = getattr(self.recorder, "seconds", 0.0) - self._comm_mark
        self.compute_s += max(0.0, wall_s - comm_s)
        self.steps += 1

    def check(self) -> tuple[list[int], list[float]]:
        """Collective over all ranks: (straggler ranks, mean compute seconds per rank); resets the window."""
        if self.spans is not None:
            self.compute_s, self.steps = self.spans.take()
        mine = self.compute_s / max(self.steps, 1)
        self.compute_s, self.steps = 0.0, 0
        if self.group is None:
            return [], [mine]
        times = self.group.all_gather_floats([mine])[:, 0].numpy()
        return np.flatnonzero(slower_than_others(times, self.factor)).tolist(), times.tolist()
