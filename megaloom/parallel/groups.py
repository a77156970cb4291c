"""Creating a rank's process groups with work that does not grow with the world.

`dist.new_group` without local synchronisation must be called by every rank for every group, and with a
device bound to the default group (megaloom's NCCL start-up) each call is a world-wide ``ncclCommSplit`` in
which non-members take part: 1,344 of them at tp 8 x pp 8 x dp 16. Instead, one call per kind of group:

- NCCL with a bound device: `dist.split_group` with the whole partition (every group of the kind), one
  ``ncclCommSplit`` of the world per kind, which is what torch's DeviceMesh (TorchTitan) does;
- otherwise (gloo, the fake backend of dry runs, NCCL initialised lazily): `dist.new_group` of this rank's
  own group with ``use_local_synchronization=True``, in which only its members take part.

Group names are then hashed from the member ranks and the number of groups this process has registered, so
the members of a group must have registered equally many before: every caller passes a partition that covers
every rank (one group per rank per call), which keeps those counts equal on all ranks.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch.distributed as dist

SPLITTING_BACKENDS = ("nccl", "xccl")  # the accelerator backends production splits (ncclCommSplit and XCCL's)


def can_split() -> bool:
    """Whether the default group can split communicators (a device bound to it and a backend that splits), which
    is what ``dist.split_group`` requires. A device is bound by `runtime.start_process_group` for an accelerator
    only: torch refuses ``device_id`` for a CPU device (torch 2.11-2.13), so a gloo world on CPU takes
    ``new_group`` (tests/parallel/test_world2.py checks that torch agrees with this answer). Only the accelerator
    backends split: a gloo world bound to a GPU (a test's stand-in) makes new groups too, because torch 2.11's
    ``split_group`` deep-copies the parent backend's options and gloo's cannot be copied (seen on an H100)."""
    pg = dist.group.WORLD
    device = getattr(pg, "bound_device_id", None)
    if device is None or dist.get_backend(pg) not in SPLITTING_BACKENDS:
        return False
    try:
        return bool(pg._get_backend(device).supports_splitting)
    except RuntimeError:
        return False


def partition_group(partition: list[list[int]], rank: int, desc: str, calls: dict[str, int] | None = None,
                    timeout: timedelta | None = None) -> Any:
    """This rank's group of ``partition`` (every world rank in exactly one part, parts ascending); collective:
    every rank calls it with the same partition. ``calls`` counts the creation calls this rank made by path
    ("split" or "new_group"; `can_split` is the one place that chooses). ``timeout``: the group's collective
    timeout (None: torch's default)."""
    mine = next((p for p in partition if rank in p), None)
    if mine is None or sum(len(p) for p in partition) != dist.get_world_size():
        raise ValueError(f"partition_group({desc}): the parts must cover every rank of the world exactly once")
    path = "split" if can_split() else "new_group"
    if calls is not None:
        calls[path] = calls.get(path, 0) + 1
    if path == "split":
        return dist.split_group(split_ranks=partition, timeout=timeout, group_desc=desc)
    return dist.new_group(mine, timeout=timeout, use_local_synchronization=True, group_desc=desc)
