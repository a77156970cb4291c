"""Train/valid splits by contiguous document ranges, parsed from ``data.split`` ("98,2")."""

from __future__ import annotations

import math

from megaloom.data.errors import DataError


def parse_split(split: str) -> tuple[float, float]:
    """(train, valid) fractions from "train,valid" or "train,valid,test" (test share is left unused)."""
    parts = [p.strip() for p in str(split).split(",")]
    try:
        values = [float(p) for p in parts]
    except ValueError:
        values = []
    if len(values) not in (2, 3) or any(not math.isfinite(v) or v < 0 for v in values) or sum(values) <= 0:
        raise DataError("data.split must be 'train,valid' or 'train,valid,test' non-negative numbers "
                        f"such as '98,2', got {split!r}")
    total = sum(values)
    return values[0] / total, values[1] / total


def split_ranges(n_docs: int, split: str) -> dict[str, tuple[int, int]]:
    """Document ranges per split: the first documents train, the following ones validate.

    Contiguous ranges (not a random document sample) keep each split a single stream that can be
    sliced straight out of the memory map, and guarantee no document is in both.
    """
    train, valid = parse_split(split)
    b1 = round(n_docs * train)
    b2 = max(b1, min(n_docs, round(n_docs * (train + valid))))
    return {"train": (0, b1), "valid": (b1, b2)}
