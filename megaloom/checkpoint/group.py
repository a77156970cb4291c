"""The ranks that save and load checkpoints together, talking over a process group of their own.

Checkpoint agreement (barriers around a save, the per-writer checksums gathered into one manifest, the vote on
whether a checkpoint verified, and DCP's own planning collectives of every save and load) runs on a gloo group
created once with a generous timeout
(`checkpoint.timeout_s`): host-side objects need a CPU backend whatever trains on the GPUs, a slow file system must
not trip NCCL's training timeout, and the background writer's messages never interleave with the training loop's
collectives (so it is a group of its own, not the loop's control group: two threads must never share one).
The trainer makes it at start-up, before any background writer exists, and its data-cache build meets on it too
(training/data.py), so nothing at start-up waits on the default (NCCL) group under the training timeout.
One process: every method is local. The methods are parallel/host_group.py's.
"""

from __future__ import annotations

from megaloom.parallel.host_group import HostGroup


class CheckpointGroup(HostGroup):
    def __init__(self, timeout_s: float = 3600.0) -> None:
        """Collective when distributed: every rank creates the group at the same point."""
        super().__init__(timeout_s)
