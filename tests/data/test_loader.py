from __future__ import annotations

import numpy as np
import pytest
import torch

from megaloom.data.errors import DataError
from megaloom.data.loader import StepBatches, batches_of, make_loader


class Rows:
    """Sample i is [i, i, i] so batches show exactly which samples they hold."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        if not 0 <= i < self.n:
            raise IndexError(i)
        return np.full(3, i, dtype=np.int64)


def test_step_k_holds_expected_samples() -> None:
    b = StepBatches(Rows(40), global_batch_size=4, start_step=2, n_steps=5)
    assert len(b) == 5
    x = b[1]
    assert x.dtype == torch.long and x.shape == (4, 3)
    assert x[:, 0].tolist() == [12, 13, 14, 15]  # step 3 = samples 12..15


def test_rank_slices_concatenate_to_global_batch() -> None:
    full = StepBatches(Rows(64), 8, n_steps=6)
    r0 = StepBatches(Rows(64), 8, rank_offset=0, rank_size=4, n_steps=6)
    r1 = StepBatches(Rows(64), 8, rank_offset=4, rank_size=4, n_steps=6)
    for k in range(6):
        assert torch.equal(torch.cat([r0[k], r1[k]]), full[k])


def test_default_n_steps_and_bounds() -> None:
    assert len(StepBatches(Rows(10), 3)) == 3
    with pytest.raises(DataError, match=r"samples"):
        StepBatches(Rows(10), 3, start_step=1, n_steps=3)
    with pytest.raises(DataError, match=r"rank slice"):
        StepBatches(Rows(10), 2, rank_offset=1, rank_size=2)
    with pytest.raises(IndexError):
        StepBatches(Rows(10), 2, n_steps=2)[2]


@pytest.mark.parametrize("workers", [0, 1])
def test_loader_yields_steps_in_order(workers: int) -> None:
    batches = StepBatches(Rows(30), 5, start_step=1, n_steps=4)
    loader = make_loader(batches, num_workers=workers, prefetch=2, pin_memory=False)
    got = [x[:, 0].tolist() for x in loader]
    assert got == [list(range(s * 5, s * 5 + 5)) for s in range(1, 5)]


def test_loader_rejects_bad_settings() -> None:
    b = StepBatches(Rows(10), 2)
    with pytest.raises(DataError, match=r"data.prefetch"):
        make_loader(b, num_workers=1, prefetch=0, pin_memory=False)
    with pytest.raises(DataError, match=r"data.num_workers"):
        make_loader(b, num_workers=-1, prefetch=2, pin_memory=False)


class _Reads:
    """A stand-in for a DataLoader's iterator: each read returns the next item, or raises it if it is an error."""

    def __init__(self, *items):
        self.items = list(items)

    def __iter__(self):
        return self

    def __next__(self):
        if not self.items:
            raise StopIteration
        item = self.items.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item


def test_a_worker_killed_mid_handover_is_named_as_torch_names_it() -> None:
    """A worker killed while handing a batch over: multiprocessing's EOFError (or a reset connection) comes
    first; the next read is the DataLoader's RuntimeError naming the dead worker, raised in its place (the
    error `megaloom train` turns into one line), chained to the first."""
    died = RuntimeError("DataLoader worker (pid(s) 4242) exited unexpectedly")
    for first in (EOFError(), ConnectionResetError(104, "Connection reset by peer")):
        got = []
        with pytest.raises(RuntimeError, match=r"DataLoader worker \(pid\(s\) 4242\)") as raised:
            for batch in batches_of(_Reads(1, 2, first, died)):
                got.append(batch)
        assert got == [1, 2] and raised.value.__cause__ is first


def test_no_batch_is_skipped_when_the_error_was_not_a_dead_worker() -> None:
    """If the read after the error returns a batch, or fails otherwise, the original error stands: the stream
    never silently moves on past a batch."""
    for after in (3, RuntimeError("something else"), StopIteration()):
        with pytest.raises(EOFError):
            list(batches_of(_Reads(1, 2, EOFError(), after, 4)))
    assert list(batches_of(_Reads(1, 2, 3))) == [1, 2, 3]
