"""Small helpers for on-disk caches: stable short keys and crash-safe array files."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np


def short_hash(*parts: Any, length: int = 16) -> str:
    """A short hex digest of JSON-serialisable ``parts``; equal inputs give equal keys across runs."""
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:length]


def tmp_name(path: Path) -> Path:
    """A sibling temporary name unique to this process, so concurrent ranks never share a temp file."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def save_npy_atomic(path: Path, array: np.ndarray) -> None:
    """Write ``array`` to ``path`` so that readers see either no file or the complete one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp_name(path)
    try:
        with open(tmp, "wb") as f:
            np.save(f, array)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


@contextmanager
def npy_writer(path: Path, shape: tuple[int, ...], dtype: np.dtype | str) -> Iterator[np.ndarray]:
    """A writable ``.npy`` memory map of ``shape`` under a temporary name, moved to ``path`` when the block
    ends without an error: arrays larger than RAM are filled piece by piece and readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp_name(path)
    try:
        out = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.dtype(dtype), shape=shape)
        yield out
        out.flush()
        del out
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def load_npy(path: Path, mmap: bool = False) -> np.ndarray | None:
    """Load a cached array (``mmap``: memory-mapped read-only, so its pages are shared by every process that
    maps it and read on demand), or None when it is missing or unreadable (the caller then recomputes)."""
    try:
        return np.load(path, allow_pickle=False, mmap_mode="r" if mmap else None)
    except (OSError, ValueError, EOFError):
        return None


def spot_check(array: np.ndarray, ok: Callable[[np.ndarray], bool], block: int = 1 << 14, blocks: int = 64) -> bool:
    """``ok`` on ``blocks`` contiguous runs of ``block`` entries spread evenly over ``array`` (the first and the
    last included): catches a foreign or garbage file while paging in a few MB of a multi-GB memory map (a
    strided sample would touch every page)."""
    n = len(array)
    if n <= block * blocks:
        return bool(ok(np.asarray(array)))
    starts = np.linspace(0, n - block, blocks).astype(np.int64)
    return all(ok(np.asarray(array[s:s + block])) for s in starts)
