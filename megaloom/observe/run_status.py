"""`megaloom status`'s first line: where a run stands as a whole (finished, or the step it reached), read from
the run directory's contract files (config.yaml, metrics.jsonl, checkpoints/) without loading anything large."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import yaml


def last_record(metrics: Path, tail_bytes: int = 1 << 16) -> dict | None:
    """The last complete JSON row of metrics.jsonl, reading only the file's tail (it grows without bound)."""
    if not metrics.is_file():
        return None
    with open(metrics, "rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - tail_bytes))
        lines = f.read().decode(errors="replace").splitlines()
    for line in reversed(lines):
        try:
            return json.loads(line)
        except ValueError:
            continue  # a torn last line, or the cut first one
    return None


def run_progress(run_dir: str | Path, now: float | None = None) -> str | None:
    """'finished: ...' or 'stopped or running: ...' for a run directory; None when it is not one."""
    run_dir = Path(run_dir)
    try:
        cfg = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
        steps = int(cfg["train"]["steps"])
    except (OSError, KeyError, TypeError, ValueError, yaml.YAMLError):
        return None
    metrics = run_dir / "metrics.jsonl"
    rec = last_record(metrics)
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*") if p.is_dir())
    ckpt = f"; newest checkpoint {ckpts[-1]}" if ckpts else "; no checkpoint"
    if rec is None:
        return f"{run_dir}: started (train.steps={steps}), no metric row yet{ckpt}"
    age = (now or time.time()) - metrics.stat().st_mtime
    loss = rec.get("loss")
    tail = f"last loss {loss:.4f}" if isinstance(loss, int | float) else "last loss -"
    if isinstance(rec.get("eval_loss"), int | float):
        tail += f", eval {rec['eval_loss']:.4f}"
    if int(rec.get("step", 0)) >= steps:
        return (f"{run_dir}: finished: step {rec['step']} of train.steps={steps}, {age:.0f}s ago; {tail}{ckpt} "
                "(raise train.steps to continue)")
    return (f"{run_dir}: at step {rec['step']} of train.steps={steps} (last metric row {age:.0f}s ago: running if "
            f"recent, else stopped; `megaloom train` resumes it); {tail}{ckpt}")
