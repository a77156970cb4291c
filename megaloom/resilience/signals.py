"""Stop requests: SIGTERM / SIGUSR1 (a scheduler's preemption notice, e.g. SLURM's `--signal`) and SIGINT (Ctrl-C)
turned into one decision that every rank takes at the same step, so that all ranks save the same checkpoint.

A signal may reach only some ranks (a node's agent, a `kill` of one process). The handler only records it; every
`check_every` steps the ranks combine their records with one all-reduce (max) of a single integer on the loop's
host-side control group (gloo: no device sync; the loop's, not the checkpoint group, whose collectives the
background writer thread issues at the same time: two threads never share a group). The all-reduce is issued at one
check and read at the next, so it completes while the next steps compute and the loop pays only for issuing it (tens
to hundreds of microseconds, measured in docs/resilience.md); the price is that the job stops up to 2 x check_every
steps after the signal. A second Ctrl-C stops at once (KeyboardInterrupt), without saving.
"""

from __future__ import annotations

import signal
import threading

import torch
import torch.distributed as dist

from megaloom.parallel.host_group import HostGroup
from megaloom.parallel.launch import STOP_SIGNALS


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


class StopRequests:
    """``poll()`` at every step boundary, on every rank: None to go on, or the signal number the job stops for
    (the same on every rank, at the same step). ``install()`` / ``restore()`` around the training loop."""

    def __init__(self, enabled: bool = True, control: HostGroup | None = None, check_every: int = 1) -> None:
        """``control``: the loop's host-side group (parallel/host_group.py); None on one process, where the
        decision is this rank's own."""
        self.enabled, self.check_every = enabled, max(1, check_every)
        self.received: int | None = None  # this rank's first stop signal
        self._previous: dict[int, object] = {}
        self._group = None
        self._pending: tuple[dist.Work, torch.Tensor] | None = None
        if enabled and control is not None and control.size > 1 and dist.get_backend() != "fake":
            self._group = control.group  # a dry run's fake group has no peers to agree with

    def install(self) -> StopRequests:
        """Route the stop signals to this object (main thread only: Python delivers signals there)."""
        if self.enabled and threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # Ctrl-C twice: stop now, without the save
        if self.received is None:
            self.received = signum

    def poll(self, step: int) -> int | None:
        """Every rank at the boundary after step `step`: the agreed stop signal, or None. Decided over the ranks
        from the records as they were at the previous check (overlapped; module doc)."""
        if not self.enabled:
            return None
        if self._group is None:
            return self.received
        if step % self.check_every:
            return None
        agreed = 0
        if self._pending is not None:
            work, flag = self._pending
            work.wait()
            agreed = int(flag.item())
            self._pending = None
        if agreed:
            return agreed
        flag = torch.tensor([self.received or 0], dtype=torch.int32)
        self._pending = (dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True), flag)
        return None

    def close(self) -> None:
        """Finish the request in flight (every rank issued it) and give the signals back."""
        if self._pending is not None:
            self._pending[0].wait()
            self._pending = None
        self.restore()
