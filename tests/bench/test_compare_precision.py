"""bench/compare_precision.py pairs each low-precision run with the bf16 run of the same seed."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from compare_precision import compare, main, split_name, summarize  # noqa: E402


def _write(d: Path, name: str, losses: list[float], eval_loss: float) -> None:
    rows = [{"step": 10 * (i + 1), "loss": x, "tokens_per_s": 1000.0} for i, x in enumerate(losses)]
    rows[-1]["eval_loss"] = eval_loss
    (d / f"metrics_{name}.jsonl").write_text("\n".join(json.dumps(r) for r in rows))


def test_pairs_by_seed_and_reports_relative_gaps(tmp_path, capsys) -> None:
    _write(tmp_path, "bf16", [5.0, 4.0, 2.0], 3.0)
    _write(tmp_path, "fp8", [5.0, 4.0, 2.02], 3.03)
    _write(tmp_path, "bf16_seed2", [5.0, 4.0, 4.0], 4.0)
    _write(tmp_path, "fp8_seed2", [5.0, 4.0, 3.96], 4.0)
    _write(tmp_path, "fp8_rowwise_seed7", [1.0], 1.0)  # no bf16 partner of seed 7: not compared
    assert split_name("fp8_rowwise_seed2") == ("fp8_rowwise", "2") and split_name("fp8") == ("fp8", "default")
    assert summarize(tmp_path / "metrics_bf16.jsonl", tail=2)["train"] == 3.0
    runs = {p.stem.removeprefix("metrics_"): summarize(p, 1) for p in tmp_path.glob("metrics_*.jsonl")}
    gaps = {(r["run"], r["seed"]): (round(r["train_gap_pct"], 6), round(r["eval_gap_pct"], 6)) for r in compare(runs)}
    assert gaps == {("fp8", "default"): (1.0, 1.0), ("fp8", "2"): (-1.0, 0.0)}
    assert main([str(tmp_path), "--tail", "1"]) == 0
    out = capsys.readouterr().out
    assert "mean over 2 seeds: train gap +0.00%" in out and "bf16 across 2 seeds" in out


def test_a_run_stopped_early_is_compared_at_the_common_step(tmp_path, capsys) -> None:
    """One run of a pair killed by its timeout: both are compared at the last step both logged, not one's end
    against the other's middle."""
    _write(tmp_path, "bf16_seed1", [5.0, 4.0, 3.0, 1.0], 2.0)
    _write(tmp_path, "fp8_blockwise_seed1", [5.0, 4.0, 3.03], 9.0)  # stopped after step 30
    runs = {p.stem.removeprefix("metrics_"): summarize(p, 1) for p in tmp_path.glob("metrics_*.jsonl")}
    (row,) = compare(runs)
    assert row["run"] == "fp8_blockwise" and row["at_step"] == 30 and round(row["train_gap_pct"], 6) == 1.0
    assert main([str(tmp_path), "--tail", "1"]) == 0 and "at step 30" in capsys.readouterr().out
