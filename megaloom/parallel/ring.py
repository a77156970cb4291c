"""A process group as a ring: each rank sends to the next and receives from the previous, without waiting.

Both ring algorithms use it: async tensor parallelism's collective matmuls (`collective_matmul.py`: sequence
chunks around the tp ring beside the GEMMs) and ring attention (`context/ring.py`: key/value blocks around the cp
ring beside the attention). The transfers are batched point-to-point sends and receives (`comm.send_recv`), so
the collective recorder and the hang watchdog see them, and the same code runs on gloo and NCCL.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from megaloom.parallel import comm
from megaloom.parallel.comm import Group, OpRecorder


class Ring:
    """This rank's neighbours in ``group`` and one non-blocking exchange with them."""

    def __init__(self, group: Group, recorder: OpRecorder | None) -> None:
        ranks = dist.get_process_group_ranks(group)
        self.size, self.rank = len(ranks), dist.get_rank(group)
        self.next, self.prev = ranks[(self.rank + 1) % self.size], ranks[(self.rank - 1) % self.size]
        self.group, self.recorder = group, recorder

    def pass_on(self, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], list]:
        """Send ``tensors`` to the next rank, receive the previous rank's into new buffers of the same shapes;
        returns (buffers, works to wait on: `wait`). The sent tensors must stay alive until then."""
        tensors = [t.contiguous() for t in tensors]  # views (transposed q/k/v) go as contiguous copies
        bufs = [torch.empty_like(t) for t in tensors]
        works = comm.send_recv([(t, self.next) for t in tensors], [(b, self.prev) for b in bufs],
                               self.group, self.recorder, wait=False)
        works.append(_KeepAlive(tensors))  # the copies are read by the backend until the wait
        return bufs, works

    def shift(self, t: torch.Tensor) -> Callable[[], torch.Tensor]:
        """`pass_on` of one tensor; returns a function that waits and gives what arrived."""
        (buf,), works = self.pass_on([t])

        def arrived() -> torch.Tensor:
            wait(works)
            return buf

        return arrived


class _KeepAlive:
    """A 'work' holding the sent tensors until `wait` drops it."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.tensors = tensors

    def wait(self) -> None:
        self.tensors = []


def wait(works: list) -> None:
    """Wait for every transfer of a `Ring.pass_on` (once: the list is emptied)."""
    for w in works:
        w.wait()
    del works[:]
