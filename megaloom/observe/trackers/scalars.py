"""The numbers of a metrics record that trackers log (a module of its own: the trackers import it, and the package
imports the trackers)."""

from __future__ import annotations

from typing import Any


def scalars(record: dict[str, Any], finite_only: bool = True) -> dict[str, float]:
    """The record's numbers (not ``step``, not booleans, not lists); ``finite_only`` drops NaN and infinities,
    which metrics.jsonl lists under ``nonfinite``."""
    out = {}
    for k, v in record.items():
        if k == "step" or isinstance(v, bool) or not isinstance(v, int | float):
            continue
        if finite_only and not (float("-inf") < v < float("inf")):
            continue
        out[k] = float(v) if isinstance(v, float) else v
    return out
