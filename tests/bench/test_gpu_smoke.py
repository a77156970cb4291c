"""The GPU smoke suite's script runs on a CPU (the models made tiny), so a device call never finds it broken."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_gpu_smoke_script_runs_its_dry_runs_on_cpu() -> None:
    # the world case (4 processes, compiled parity) is what tests/parallel's worlds already prove on CPU
    out = subprocess.run([sys.executable, "bench/gpu_smoke.py", "--device", "cpu", "--only", "dense,moe,cp,fp8"],
                         capture_output=True, text=True, cwd=ROOT, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = [x for x in out.stdout.splitlines() if x.startswith("SMOKE ")]
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert [x.split()[1:3] for x in lines[1:-1]] == [["dense", "PASS"], ["moe", "PASS"], ["cp", "PASS"],
                                                      ["fp8", "PASS"]], lines
    assert lines[-1] == "SMOKE SUMMARY 4 passed, 0 failed"
