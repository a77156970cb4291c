"""Where metrics go: metrics.jsonl (the contract), the trackers (TensorBoard, W&B, MLflow), and a console line for
humans."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any


class MetricsSink:
    """Appends one JSON object per logged step to run_dir/metrics.jsonl and mirrors its numbers to the trackers
    (`run.trackers`: TensorBoard, W&B, MLflow; observe/trackers/), each imported only when asked for and dropped
    with one warning line if it fails.

    Only rank 0 writes (the caller constructs it with enabled=False elsewhere).
    """

    def __init__(self, run_dir: Path, tensorboard: bool, enabled: bool = True, trackers: Sequence[str] = (),
                 config: dict | None = None, project: str = "megaloom", mlflow_uri: str = "",
                 trackers_optional: bool = False):
        """``tensorboard``: TensorBoard event files in run_dir (``run.tensorboard`` with tensorboard in
        ``run.trackers``); ``trackers``: the others by name; ``config``: the resolved config they record;
        ``trackers_optional``: a tracker that cannot start warns (else ConfigError)."""
        self.enabled = enabled
        self.path = run_dir / "metrics.jsonl"
        self.trackers = []
        if enabled:
            from megaloom.observe.trackers import open_trackers

            names = (["tensorboard"] if tensorboard else []) + [t for t in trackers if t != "tensorboard"]
            self.trackers = open_trackers(names, run_dir, config, project, mlflow_uri, trackers_optional)

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(json_record(record), allow_nan=False) + "\n")
        for tracker in self.trackers:
            tracker.log(record, record["step"])

    def truncate_after(self, step: int) -> int:
        """Drop the records of steps after `step` (a resume or rollback to `step` replays them), so that
        metrics.jsonl holds one row per step. Atomic: a reader sees the old file or the new one. Returns how
        many rows were dropped."""
        if not self.enabled or not self.path.is_file():
            return 0
        lines = self.path.read_text().splitlines(keepends=True)
        keep = [line for line in lines if not line.strip() or _step_of(line) <= step]
        if len(keep) == len(lines):
            return 0
        tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        tmp.write_text("".join(keep))
        os.replace(tmp, self.path)
        return len(lines) - len(keep)

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()


def _step_of(line: str) -> int:
    try:
        return int(json.loads(line).get("step", -1))
    except (ValueError, AttributeError, TypeError):
        return -1  # not a record (a torn last line of a killed run): kept, readers skip what they cannot parse


def _finite(v: Any) -> Any:
    """``v`` with every non-finite float (also inside lists and dicts) replaced by None."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, list | tuple):
        return [_finite(x) for x in v]
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    return v


def json_record(record: dict[str, Any]) -> dict[str, Any]:
    """The record as strict JSON: NaN and infinities are not JSON (Python writes a bare `NaN` other readers
    refuse), so they become null and the keys that held one are listed under ``nonfinite``, e.g.
    ``"loss": null, ..., "nonfinite": ["loss", "grad_norm"]``. (mfu is null on CPUs by design: not listed.)"""
    clean = {k: _finite(v) for k, v in record.items()}
    bad = [k for k, v in record.items() if k != "mfu" and clean[k] != v and v is not None]
    if bad:
        clean["nonfinite"] = bad
    return clean


def format_eta(seconds: float) -> str:
    seconds = int(max(0, seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


def console_line(r: dict[str, Any], total_steps: int, eta_s: float) -> str:
    mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "-"
    return (f"step {r['step']:>6}/{total_steps} | loss {r['loss']:.4f} | lr {r['lr']:.2e} | "
            f"gnorm {r['grad_norm']:.3f} | {r['tokens_per_s']:,.0f} tok/s | mfu {mfu} | "
            f"mem {r['mem_gb']:.2f} GB | eta {format_eta(eta_s)}")


def read_jsonl(path: str | Path) -> list[dict]:
    """The objects of a JSON-lines file, one per non-empty line; [] when the file does not exist."""
    path = Path(path)
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def read_metrics(run: str | Path) -> list[dict]:
    """A run's records: ``run`` is its directory (``run/metrics.jsonl``) or a metrics file itself (one kept
    elsewhere, e.g. under bench/artifacts/)."""
    run = Path(run)
    return read_jsonl(run if run.is_file() else run / "metrics.jsonl")
