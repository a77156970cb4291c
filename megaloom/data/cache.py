"""Small helpers for on-disk caches: stable short keys and crash-safe array files."""

from __future__ import annotations

import hashlib
import json
import os
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


def load_npy(path: Path) -> np.ndarray | None:
    """Load a cached array, or None when it is missing or unreadable (the caller then recomputes)."""
    try:
        return np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError):
        return None
