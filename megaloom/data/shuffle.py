"""Epoch-wise shuffling whose order never depends on how many samples were asked for."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from megaloom.data.cache import load_npy, save_npy_atomic
from megaloom.data.errors import DataError


def _epoch_permutation(n_samples: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(n_samples)


def shuffled_index(n_samples: int, n_needed: int, seed: int, cache_file: Path | None = None) -> np.ndarray:
    """The first ``n_needed`` entries of an endless sequence of per-epoch permutations of ``n_samples``.

    Each epoch has its own generator seeded by ``(seed, epoch)``, so entry ``i`` is the same whether
    1 000 or 1 000 000 entries are requested: a resumed or extended run sees exactly the same data.
    ``cache_file`` (whose name must encode everything the index depends on) stores it as ``.npy``.
    """
    if n_samples < 1:
        raise DataError(f"cannot shuffle an empty dataset (0 samples) for {n_needed} requested samples")
    if n_needed < 0:
        raise DataError(f"number of samples requested must be >= 0, got {n_needed}")
    if cache_file is not None:
        cached = load_npy(Path(cache_file))
        # The length and range checks catch a foreign or stale file; its name carries the real key.
        if cached is not None and cached.ndim == 1 and len(cached) >= n_needed:
            cached = cached[:n_needed]
            if n_needed == 0 or (cached.min() >= 0 and cached.max() < n_samples):
                return cached.astype(np.int64, copy=False)
    n_epochs = -(-n_needed // n_samples)
    parts = [_epoch_permutation(n_samples, seed, e) for e in range(n_epochs)]
    index = np.concatenate(parts)[:n_needed] if parts else np.zeros(0, dtype=np.int64)
    index = index.astype(np.int64, copy=False)
    if cache_file is not None:
        save_npy_atomic(Path(cache_file), index)
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
