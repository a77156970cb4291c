"""Epoch-wise shuffling whose order never depends on how many samples were asked for."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from megaloom.data.cache import load_npy, npy_writer, spot_check
from megaloom.data.errors import DataError


def _epoch_permutation(n_samples: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(n_samples)


def _fill(out: np.ndarray, n_samples: int, seed: int) -> None:
    """Epoch permutations written one after another into ``out``: one epoch in RAM at a time."""
    for e, pos in enumerate(range(0, len(out), n_samples)):
        part = _epoch_permutation(n_samples, seed, e)
        out[pos:pos + n_samples] = part[:len(out) - pos]


def load_shuffled_index(cache_file: Path, n_samples: int, n_needed: int) -> np.ndarray | None:
    """The cached index memory-mapped (nothing read until used), or None when missing, short or foreign."""
    cached = load_npy(Path(cache_file), mmap=True)
    # The length and range checks catch a foreign or stale file; its name carries the real key.
    if cached is None or cached.ndim != 1 or cached.dtype != np.int64 or len(cached) < n_needed:
        return None
    cached = cached[:n_needed]
    if n_needed and not spot_check(cached, lambda a: a.min() >= 0 and a.max() < n_samples):
        return None
    return cached


def shuffled_index(n_samples: int, n_needed: int, seed: int, cache_file: Path | None = None) -> np.ndarray:
    """The first ``n_needed`` entries of an endless sequence of per-epoch permutations of ``n_samples``.

    Each epoch has its own generator seeded by ``(seed, epoch)``, so entry ``i`` is the same whether
    1 000 or 1 000 000 entries are requested: a resumed or extended run sees exactly the same data.
    ``cache_file`` (whose name must encode everything the index depends on) stores it as ``.npy``, written
    epoch by epoch and atomically; it is returned memory-mapped, so processes that share the file share its
    pages instead of each holding a private copy.
    """
    if n_samples < 1:
        raise DataError(f"cannot shuffle an empty dataset (0 samples) for {n_needed} requested samples")
    if n_needed < 0:
        raise DataError(f"number of samples requested must be >= 0, got {n_needed}")
    if cache_file is None or n_needed == 0:
        index = np.empty(n_needed, dtype=np.int64)
        _fill(index, n_samples, seed)
        return index
    cached = load_shuffled_index(Path(cache_file), n_samples, n_needed)
    if cached is not None:
        return cached
    with npy_writer(Path(cache_file), (n_needed,), np.int64) as out:
        _fill(out, n_samples, seed)
    index = load_shuffled_index(Path(cache_file), n_samples, n_needed)
    if index is None:
        raise DataError(f"the shuffled index just written to {cache_file} cannot be read back; check the disk "
                        "under data.cache_dir ($MEGALOOM_CACHE)")
    return index


class ShuffledDataset:
    """``n_needed`` samples of ``base`` in shuffled order, repeating (reshuffled) epochs as needed."""

    def __init__(self, base, n_needed: int, seed: int, cache_file: Path | None = None) -> None:
        self.base = base
        self.index = shuffled_index(len(base), n_needed, seed, cache_file)

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.base[int(self.index[i])]
