"""Mixing several datasets in fixed proportions, deterministically and prefix-stably."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from megaloom.data.errors import DataError


def normalize_weights(weights: Sequence[float], setting: str = "data.weights") -> list[float]:
    """Weights scaled to sum to 1, rejecting negative, non-finite or all-zero values."""
    w = [float(x) for x in weights]
    if any(not math.isfinite(x) or x < 0 for x in w):
        raise DataError(f"{setting} must be finite and non-negative, got {list(weights)}")
    total = sum(w)
    if total <= 0:
        raise DataError(f"{setting} must not all be zero, got {list(weights)}; give at least one dataset a "
                        "positive weight")
    return [x / total for x in w]


def blend_plan(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset id, index within that dataset) for each of ``size`` global samples.

    Sample ``i`` goes to the dataset furthest behind its target share: argmax of
    ``w[d] * (i + 1) - count[d]`` (lowest ``d`` on ties). Every dataset then stays within one sample
    of its share at every prefix, and the choice for ``i`` never depends on ``size``.
    """
    w = normalize_weights(weights)
    n = len(w)
    if n == 1:
        return np.zeros(size, dtype=np.int32), np.arange(size, dtype=np.int64)
    counts = [0] * n
    ids = [0] * size
    local = [0] * size
    rest = range(1, n)
    # A plain-Python loop over floats: per-step numpy calls would be ~10x slower for a handful of datasets.
    for i in range(size):
        t = i + 1
        best, best_err = 0, w[0] * t - counts[0]
        for d in rest:
            err = w[d] * t - counts[d]
            if err > best_err:
                best, best_err = d, err
        ids[i] = best
        local[i] = counts[best]
        counts[best] += 1
    return np.asarray(ids, dtype=np.int32), np.asarray(local, dtype=np.int64)


class BlendedDataset:
    """``size`` samples drawn from ``datasets`` in proportion to ``weights`` (see ``blend_plan``).

    Each component must hold at least as many samples as the plan takes from it; callers size a
    ``ShuffledDataset`` per component from ``np.bincount`` of the plan and pass ``plan`` back in to
    avoid computing it twice.
    """

    def __init__(self, datasets: list, weights: list[float], size: int,
                 plan: tuple[np.ndarray, np.ndarray] | None = None) -> None:
        if len(datasets) != len(weights) or not datasets:
            raise DataError(f"need one weight per dataset, got {len(weights)} weights for "
                            f"{len(datasets)} datasets")
        self.datasets = datasets
        self.dataset_ids, self.local_ids = plan if plan is not None else blend_plan(weights, size)
        if len(self.dataset_ids) != size:
            raise DataError(f"blend plan has {len(self.dataset_ids)} entries, expected {size}")
        for d, need in enumerate(np.bincount(self.dataset_ids, minlength=len(datasets))):
            if len(datasets[d]) < need:
                raise DataError(f"blended dataset {d} has {len(datasets[d])} samples but the blend takes "
                                f"{need} from it; wrap it in a ShuffledDataset of that length")

    def __len__(self) -> int:
        return len(self.dataset_ids)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.datasets[self.dataset_ids[i]][int(self.local_ids[i])]
