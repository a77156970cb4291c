"""bench/record.py: peer summaries become result rows of the same call; nothing is appended twice."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from record import main  # noqa: E402


def test_record_appends_once_and_compares_with_the_peer(tmp_path, capsys) -> None:
    out = tmp_path / "out"
    out.mkdir()
    ours = {"run_id": "R1", "date": "2026-12-02", "gpu": "NVIDIA H200", "torch": "2.11", "framework": "megaloom",
            "model": "llama3-1b-untied", "micro_batch": 4, "precision": "bf16", "tokens_per_s": 66000, "mfu": 0.6,
            "peak_mem_gb": 42.0, "commit": "abc", "profile": {"busy_ms": 1.0}}
    (out / "results.jsonl").write_text(json.dumps(ours) + "\n")
    peers = [{"run": "titan_compile_bs4.log", "tps": 60000, "mfu_titan_formula_989": 54.0, "mem_reserved_gib": 50.7,
              "err": ""},
             {"run": "titan_compile_bs8.log", "tps": 55000, "mfu_titan_formula_989": 50.0, "err": ""},
             {"run": "titan_compile_fp8_nooutput_bs4.log", "tps": 0, "err": "OOM"}]  # failed runs are left out
    (out / "peer_summary.jsonl").write_text("\n".join(json.dumps(p) for p in peers) + "\n")
    results = tmp_path / "results.jsonl"
    assert main([str(out), "--results", str(results)]) == 0
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    assert [r["framework"] for r in rows] == ["megaloom", "torchtitan-0.2.2", "torchtitan-0.2.2"]
    assert [r["micro_batch"] for r in rows[1:]] == [4, 8]
    assert "profile" not in rows[0]
    peer = rows[1]
    assert (peer["run_id"], peer["commit"], peer["gpu"], peer["mfu"]) == ("R1", "abc", "NVIDIA H200", 0.54)
    assert "| 1.100x |" in capsys.readouterr().out  # against the peer's best setting (mb 4 here)
    assert main([str(out), "--results", str(results)]) == 0  # the same call recorded again: nothing new
    assert len(results.read_text().splitlines()) == 3


def test_record_keeps_each_round_of_an_alternated_ab(tmp_path) -> None:
    """Two rounds of one configuration in one call (run_speed.sh bf16res, overlap) are two measurements: both land."""
    out = tmp_path / "out"
    out.mkdir()
    row = {"run_id": "R2", "date": "2026-12-04", "gpu": "NVIDIA H200", "framework": "megaloom", "mfu": 0.575,
           "model": "llama3-1b-untied", "micro_batch": 4, "precision": "bf16", "bf16_residual": True}
    rounds = [dict(row, tokens_per_s=63024), dict(row, tokens_per_s=63051)]
    (out / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rounds))
    results = tmp_path / "results.jsonl"
    assert main([str(out), "--results", str(results)]) == 0
    assert [json.loads(line)["tokens_per_s"] for line in results.read_text().splitlines()] == [63024, 63051]
