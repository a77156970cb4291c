"""Per-step batches and the DataLoader that prepares them in the background."""

from __future__ import annotations

import signal
from collections.abc import Iterable, Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from megaloom.data.errors import DataError


class StepBatches(Dataset):
    """Item ``k`` is this rank's slice of the global batch for optimizer step ``start_step + k``.

    Indexing by step (not by sample) makes resuming trivial, start at ``start_step``, and lets each
    data-parallel rank read only its ``rank_size`` samples at ``rank_offset`` of every global batch.
    ``n_steps=None`` means as many steps as the dataset holds.
    """

    def __init__(self, dataset, global_batch_size: int, rank_offset: int = 0, rank_size: int | None = None,
                 start_step: int = 0, n_steps: int | None = None) -> None:
        rank_size = global_batch_size - rank_offset if rank_size is None else rank_size
        if global_batch_size < 1:
            raise DataError(f"global batch size must be at least 1, got {global_batch_size}")
        if rank_offset < 0 or rank_size < 1 or rank_offset + rank_size > global_batch_size:
            raise DataError(f"rank slice [{rank_offset}, {rank_offset + rank_size}) does not fit in the "
                            f"global batch of {global_batch_size}")
        available = len(dataset) // global_batch_size - start_step
        n_steps = available if n_steps is None else n_steps
        if start_step < 0 or n_steps < 0 or n_steps > available:
            raise DataError(f"steps {start_step}..{start_step + n_steps - 1} need "
                            f"{(start_step + n_steps) * global_batch_size} samples but the dataset has "
                            f"{len(dataset)}; build it with more samples")
        self.dataset, self.gbs = dataset, global_batch_size
        self.rank_offset, self.rank_size = rank_offset, rank_size
        self.start_step, self.n_steps = start_step, n_steps

    def __len__(self) -> int:
        return self.n_steps

    def __getitem__(self, k: int) -> torch.Tensor:
        if not 0 <= k < self.n_steps:
            raise IndexError(f"step item {k} out of range ({self.n_steps} steps)")
        first = (self.start_step + k) * self.gbs + self.rank_offset
        return stack_rows([self.dataset[i] for i in range(first, first + self.rank_size)])


def stack_rows(rows: list):
    """Samples -> one batch: token rows [B, T+1] int64, or an `ImageTextBatch` of image-text rows (dicts)."""
    if isinstance(rows[0], dict):
        from megaloom.data.image_text.batch import ImageTextBatch

        return ImageTextBatch.stack(rows)
    return torch.from_numpy(np.stack(rows).astype(np.int64, copy=False))


def ignore_stop_signals(worker_id: int = 0) -> None:
    """A data-loader worker's start (``worker_init_fn``): ignore the signals the trainer turns into a save and a
    stop, and die with the trainer.

    torchrun stops a worker by signalling its whole process group (a scheduler or a terminal may signal every
    process too), so the loader's workers get the SIGTERM meant for the trainer. With the default action (torch's
    worker handler ends the worker unless the trainer itself sent the signal) they died at once, and the trainer's
    next batch or collective failed with "DataLoader worker (pid ...) is killed by signal: Terminated" before it
    could save. Ignored here, the trainer decides: it saves, stops and shuts its workers down. A worker still
    ends with the trainer however the trainer ends: the loader's shutdown, torch's check that the parent lives,
    and (Linux) the kernel's SIGKILL when the trainer dies (PR_SET_PDEATHSIG)."""
    from megaloom.parallel.launch import STOP_SIGNALS, die_with_parent

    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    die_with_parent()


def make_loader(batches: StepBatches, num_workers: int, prefetch: int, pin_memory: bool) -> DataLoader:
    """A DataLoader yielding ``batches`` in step order, built ahead by ``num_workers`` processes so that
    reading and stacking overlap with the forward/backward pass. The workers ignore the trainer's stop signals
    (`ignore_stop_signals`)."""
    if num_workers < 0:
        raise DataError(f"data.num_workers must be >= 0, got {num_workers}")
    if num_workers > 0 and prefetch < 1:
        raise DataError(f"data.prefetch must be >= 1 when data.num_workers > 0, got {prefetch}")
    return DataLoader(
        batches,
        batch_size=None,  # items are already whole batches
        shuffle=False,  # order is the step order; shuffling happened in the sample index
        num_workers=num_workers,
        pin_memory=pin_memory,
        persistent_workers=num_workers > 0,
        prefetch_factor=prefetch if num_workers > 0 else None,
        worker_init_fn=ignore_stop_signals if num_workers > 0 else None,
        # The loader draws a base seed when an iterator starts; a private generator keeps that draw off the
        # global RNG, so a resumed run's dropout stream is exactly the uninterrupted run's.
        generator=torch.Generator().manual_seed(0),
    )


def batches_of(loader: Iterable) -> Iterator:
    """Iterate ``loader``, so that a data-loader worker's death reads as torch's RuntimeError naming it.

    A worker killed while it hands a batch over (its shared memory's file descriptor in flight) surfaces in this
    process as EOFError or ConnectionError from multiprocessing, before the DataLoader has seen the worker die (it
    looks at its workers only after a failed read). One more read lets it look: it then raises "DataLoader worker
    (pid(s) N) exited unexpectedly", which `megaloom train` turns into one line. If that read returns a batch
    instead, the original error is raised: no batch is ever skipped."""
    it = iter(loader)
    while True:
        try:
            batch = next(it)
        except StopIteration:
            return
        except (EOFError, ConnectionError) as e:
            try:
                next(it)
            except RuntimeError as died:
                if "DataLoader worker" in str(died):
                    raise died from e
            except Exception:  # noqa: BLE001 - the original error is the one to report
                pass
            raise
        yield batch
