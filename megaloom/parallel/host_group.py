"""A process group for host-side agreement: CPU tensors and Python objects, whatever backend trains.

The training groups of a GPU job are NCCL groups, and NCCL has no CPU backend: a CPU tensor sent over them
raises "No backend type associated with device type cpu". Decisions the ranks share about the run itself (the
straggler check's per-rank times, the doctor's table, checkpoint agreement) are small host-side values, so
they travel over a gloo group created once, with a timeout of its own. A dry run's fake process group stays
fake (no peers to meet), and its exchanges answer locally (`comm.is_fake`: what a uniform job's rank would
receive), since a fake group moves no data. Without torch.distributed (one process) every method is local.

The methods issue their collective whenever a group exists, even of size 1, so the code path a job of
thousands of ranks runs is the one a one-process test runs.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from megaloom.parallel import comm
from megaloom.parallel.comm import _all_gather_single  # the all-gather's name in this torch version


class HostGroup:
    def __init__(self, timeout_s: float) -> None:
        """Collective when distributed: every rank creates the group at the same point."""
        if dist.is_available() and dist.is_initialized():
            backend = None if dist.get_backend() == "fake" else "gloo"
            self.group = dist.new_group(backend=backend, timeout=timedelta(seconds=timeout_s))
            self.rank, self.size = dist.get_rank(), dist.get_world_size()
        else:
            self.group, self.rank, self.size = None, 0, 1

    def barrier(self) -> None:
        if self.group is not None:
            dist.barrier(group=self.group)

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` on rank 0 (None elsewhere). Small objects only (checksums, verdicts)."""
        if self.group is None:
            return [obj]
        return comm.gather_objects(obj, self.group)

    def all_gather(self, obj: Any) -> list[Any]:
        if self.group is None:
            return [obj]
        return comm.all_gather_objects(obj, self.group)

    def all_true(self, ok: bool) -> bool:
        """True on every rank iff ``ok`` on every rank: one decision for the job."""
        if self.group is None or comm.is_fake(self.group):
            return ok
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return bool(flag.item())

    def all_gather_floats(self, values: list[float]) -> torch.Tensor:
        """Every rank's row of ``len(values)`` float64s: a [size, len(values)] CPU tensor in rank order.

        One tensor collective of size x n values (no pickling): what a per-rank statistic costs at 8,192 ranks.
        """
        mine = torch.tensor(values, dtype=torch.float64).reshape(1, -1)
        if self.group is None:
            return mine
        if comm.is_fake(self.group):
            return mine.repeat(self.size, 1)
        out = torch.empty(self.size, mine.shape[1], dtype=torch.float64)
        _all_gather_single(out, mine, group=self.group)
        return out

    def broadcast_int(self, value: int, src: int = 0) -> int:
        """``value`` of global rank ``src`` on every rank."""
        if self.group is None:
            return value
        return comm.broadcast_int(value, src, self.group)  # the group spans the world: group rank = global rank
