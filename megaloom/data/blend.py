"""Mixing several datasets in fixed proportions, deterministically and prefix-stably."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from megaloom.data.cache import load_npy, npy_writer
from megaloom.data.errors import DataError

# Steps per segment of the vectorised greedy (see `_greedy_ids`) and segments simulated side by side.
SEGMENT = 4096
SEGMENTS_PER_BLOCK = 4096


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


def _largest_remainder(w: np.ndarray, t: np.ndarray) -> np.ndarray:
    """Counts per dataset after ``t`` samples by largest remainders: a guess of the greedy's state that already
    sums to ``t`` (the greedy conserves that sum, so only a guess with the right sum can meet its trajectory)."""
    x = w[None, :] * t[:, None].astype(np.float64)
    fl = np.floor(x).astype(np.int64)
    order = np.argsort(-(x - fl), axis=1, kind="stable")
    rank = np.argsort(order, axis=1)
    return fl + (rank < (t - fl.sum(1))[:, None])


def _run_segments(w: np.ndarray, t0: np.ndarray, start: np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray]:
    """The greedy run for ``length`` steps from counts ``start`` after ``t0`` samples, for every row at once.
    Returns (dataset ids, shape (rows, length), counts at the end). Same float expressions as the rule."""
    n = len(w)
    flat_row = np.arange(len(t0)) * n
    counts = start.astype(np.float64).reshape(-1)  # exact integers far below 2**53, flat (rows * n)
    ids = np.empty((length, len(t0)), dtype=np.int32)
    t = t0.astype(np.float64)
    err = np.empty((len(t0), n))
    for j in range(length):  # a loop over the steps of a segment, each one vectorised over all segments
        t += 1.0  # exact: integers
        np.multiply(t[:, None], w[None, :], out=err)
        np.subtract(err, counts.reshape(err.shape), out=err)
        d = err.argmax(axis=1)  # first maximum: the lowest id wins ties
        ids[j] = d
        counts[flat_row + d] += 1
    counts = counts.reshape(len(t0), n)
    return ids.T, counts.astype(np.int64)


def _greedy_ids(w: np.ndarray, first: int, size: int, start: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Dataset ids of samples ``first .. first + size - 1`` by the greedy rule, given the exact counts ``start``
    after ``first`` samples; also the counts after them.

    The samples are cut into segments that are simulated side by side, each from a guessed start state
    (largest remainders). A segment is exact once its start equals the previous segment's end, and the
    greedy forgets a wrong start within a few steps, so re-running the few mismatched segments from their
    predecessor's end converges in a handful of passes; the loop stops only when every start matches, which
    makes the result exactly the sequential rule's whatever the convergence.
    """
    seg = max(1, min(SEGMENT, size))
    n_seg = -(-size // seg)
    t0 = first + np.arange(n_seg, dtype=np.int64) * seg
    starts = _largest_remainder(w, t0)
    starts[0] = start
    ids = np.empty((n_seg, seg), dtype=np.int32)
    ends = np.empty_like(starts)
    todo = np.arange(n_seg)
    while len(todo):
        ids[todo], ends[todo] = _run_segments(w, t0[todo], starts[todo], seg)
        todo = np.flatnonzero((starts[1:] != ends[:-1]).any(axis=1)) + 1
        starts[todo] = ends[todo - 1]
    flat = ids.reshape(-1)[:size]
    end = start + np.bincount(flat, minlength=len(w))
    return flat, end


def blend_blocks(weights: Sequence[float], size: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """`blend_plan` in consecutive blocks (dataset ids, local indices), so a plan larger than RAM can be
    streamed to disk."""
    w = np.asarray(normalize_weights(weights), dtype=np.float64)
    counts = np.zeros(len(w), dtype=np.int64)
    block = SEGMENT * SEGMENTS_PER_BLOCK
    for first in range(0, size, block):
        ids, end = _greedy_ids(w, first, min(block, size - first), counts)
        local = np.empty(len(ids), dtype=np.int64)
        for d in range(len(w)):  # the k-th sample of dataset d is its local index counts[d] + k
            where = np.flatnonzero(ids == d)
            local[where] = counts[d] + np.arange(len(where), dtype=np.int64)
        counts = end
        yield ids, local


def blend_plan(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset id, index within that dataset) for each of ``size`` global samples.

    Sample ``i`` goes to the dataset furthest behind its target share: argmax of
    ``w[d] * (i + 1) - count[d]`` (lowest ``d`` on ties). Every dataset then stays within one sample
    of its share at every prefix, and the choice for ``i`` never depends on ``size``. Computed with numpy
    (`_greedy_ids`), sample for sample identical to the rule applied one sample at a time.
    """
    w = normalize_weights(weights)
    if len(w) == 1:
        return np.zeros(size, dtype=np.int32), np.arange(size, dtype=np.int64)
    parts = list(blend_blocks(w, size))
    if not parts:
        return np.zeros(0, dtype=np.int32), np.zeros(0, dtype=np.int64)
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


def cached_blend_plan(weights: Sequence[float], size: int, stem: Path) -> tuple[np.ndarray, np.ndarray]:
    """`blend_plan` stored as ``stem-ids.npy`` / ``stem-local.npy`` (written block by block, atomically, the
    local indices last) and returned memory-mapped; ``stem`` must encode the weights and the size."""
    ids_path, local_path = Path(f"{stem}-ids.npy"), Path(f"{stem}-local.npy")
    for _ in range(2):
        ids, local = load_npy(ids_path, mmap=True), load_npy(local_path, mmap=True)
        if ids is not None and local is not None and ids.shape == local.shape == (size,):
            return ids, local
        with npy_writer(ids_path, (size,), np.int32) as ids_out, npy_writer(local_path, (size,), np.int64) as loc_out:
            pos = 0
            for block_ids, block_local in blend_blocks(weights, size):
                ids_out[pos:pos + len(block_ids)] = block_ids
                loc_out[pos:pos + len(block_ids)] = block_local
                pos += len(block_ids)
    raise DataError(f"the blend plan just written to {ids_path} cannot be read back; check the disk under "
                    "data.cache_dir ($MEGALOOM_CACHE)")


class BlendedDataset:
    """``size`` samples drawn from ``datasets`` in proportion to ``weights`` (see ``blend_plan``).

    Each component must hold at least as many samples as the plan takes from it; callers size a
    ``ShuffledDataset`` per component from the plan's counts and pass ``plan`` (and ``counts``) back in to
    avoid computing them twice. One dataset needs no plan: sample ``i`` is its sample ``i``.
    """

    def __init__(self, datasets: list, weights: list[float], size: int,
                 plan: tuple[np.ndarray, np.ndarray | None] | None = None,
                 counts: np.ndarray | None = None) -> None:
        if len(datasets) != len(weights) or not datasets:
            raise DataError(f"need one weight per dataset, got {len(weights)} weights for "
                            f"{len(datasets)} datasets")
        self.datasets = datasets
        if plan is None:
            plan = (np.broadcast_to(np.int32(0), (size,)), None) if len(datasets) == 1 else blend_plan(weights, size)
        self.dataset_ids, self.local_ids = plan
        if len(self.dataset_ids) != size:
            raise DataError(f"blend plan has {len(self.dataset_ids)} entries, expected {size}")
        if counts is None:
            counts = (np.array([size]) if self.local_ids is None
                      else np.bincount(self.dataset_ids, minlength=len(datasets)))
        for d, need in enumerate(counts):
            if len(datasets[d]) < need:
                raise DataError(f"blended dataset {d} has {len(datasets[d])} samples but the blend takes "
                                f"{need} from it; wrap it in a ShuffledDataset of that length")

    def __len__(self) -> int:
        return len(self.dataset_ids)

    def __getitem__(self, i: int) -> np.ndarray:
        if self.local_ids is None:
            return self.datasets[0][int(i)]
        return self.datasets[self.dataset_ids[i]][int(self.local_ids[i])]
