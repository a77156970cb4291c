"""The ranks that save and load checkpoints together, talking over a process group of their own.

Checkpoint agreement (barriers around a save, the per-writer checksums gathered into one manifest, the vote on
whether a checkpoint verified) runs on a gloo group created once with a generous timeout
(`checkpoint.timeout_s`): host-side objects need a CPU backend whatever trains on the GPUs, a slow file system must
not trip NCCL's training timeout, and the background writer's messages never interleave with the training loop's
collectives. One process: every method is local.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


class CheckpointGroup:
    def __init__(self, timeout_s: float = 3600.0) -> None:
        """Collective when distributed: every rank creates the group at the same point."""
        if dist.is_available() and dist.is_initialized():
            # gloo for host-side objects; a dry run's fake process group stays fake (no peers to meet)
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
        out = [None] * self.size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=self.group)
        return out

    def all_gather(self, obj: Any) -> list[Any]:
        if self.group is None:
            return [obj]
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def all_true(self, ok: bool) -> bool:
        """True on every rank iff ``ok`` on every rank: one decision for the job."""
        if self.group is None:
            return ok
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return bool(flag.item())
