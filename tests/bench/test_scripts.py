"""The benchmark entry points still run: each device call costs scarce GPU minutes, so breakage is caught here on
CPU (argument plumbing, the profile table, the result row), and the shell drivers at least parse."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("script", sorted(p.name for p in (ROOT / "bench").glob("*.sh")))
def test_shell_drivers_parse(script: str) -> None:
    subprocess.run(["bash", "-n", str(ROOT / "bench" / script)], check=True)


def test_bench_train_runs_on_cpu_with_the_race_options(tmp_path) -> None:
    results = tmp_path / "rows.jsonl"
    cmd = [sys.executable, str(ROOT / "bench" / "bench_train.py"), "--preset", "tiny", "--seq-len", "32",
           "--micro-batch", "2", "--steps", "2", "--warmup", "1", "--device", "cpu", "--fused-loss",
           "--precision", "fp8", "--no-fp8-fast-accum", "--fp8-keep-attention", "--profile", str(tmp_path / "prof"),
           "--results", str(results), "--run-id", "T", "model.vocab_size=256", "model.n_layers=3"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=tmp_path, timeout=300).stdout
    assert "kind" in out and "step (unprofiled median)" in out
    row = json.loads(results.read_text())
    assert row["run_id"] == "T" and row["fp8_fast_accum"] is False and row["fp8_keep_attention"] is True
    assert row["fused_loss"] and row["tokens_per_s"] > 0 and "profile" in row
    assert (tmp_path / "prof" / "trace.json.gz").is_file()


@pytest.mark.skipif(not __import__("importlib").util.find_spec("transformers"), reason="needs transformers")
def test_hf_fullsize_runs_its_tiny_smoke_case(tmp_path) -> None:
    """bench/hf_fullsize.py at tiny sizes on CPU: every released config through the import and export mappings,
    logits against transformers; with transformers' RoPE tables the logits are bit-identical."""
    rows = tmp_path / "rows.jsonl"
    for extra in ([], ["--hf-rope"]):
        cmd = [sys.executable, str(ROOT / "bench" / "hf_fullsize.py"), "--tiny", "--models",
               "llama-3.1-8b,mixtral-8x7b", "--out", str(rows), *extra]
        subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=tmp_path, timeout=300)
    got = [json.loads(line) for line in rows.read_text().splitlines()]
    assert len(got) == 4 and all(r["ok"] and r["export_equal"] for r in got)
    assert all(r["max_abs_err"] == 0.0 for r in got if r["hf_rope"] and r["model"] == "llama-3.1-8b")
