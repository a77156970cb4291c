"""The NCCL half of issue 19's checks, for a GPU host (skipped without one): run on one H200 with
`python -m pytest -q -m gpu tests/resilience/test_ncclsafe_gpu.py` (two GPUs: the straggler/doctor world is 2)."""

from __future__ import annotations

import json
import multiprocessing as mp
import time
from pathlib import Path

import pytest
import torch

from tests.parallel.harness import run_world
from tests.resilience import ncclsafe_worlds
from tests.resilience.test_ncclsafe import NO_CPU_BACKEND

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_straggler_check_and_doctor_in_an_nccl_world():
    world = min(2, torch.cuda.device_count())  # NCCL forbids two ranks on one GPU
    results = run_world(world, ncclsafe_worlds.gpu_host_side_cases, timeout=300)
    for res in results:
        assert res["world_backend"] == "nccl" and res["control_backend"] == "gloo"
        assert NO_CPU_BACKEND in res["world_cpu_error"]  # what the old straggler check ran into
        assert res["stragglers"] == ([1] if world == 2 else [])
        assert len(res["times"]) == world
        assert res["doctor_code"] == 0


def test_a_slow_gpu_is_named_by_device_timing():
    """Issue 35: on a GPU the straggler check times each rank's compute with CUDA events (NCCL returns at
    enqueue, so host clocks see equal ranks). Two processes share the one GPU; the last one's matmuls are 64x
    larger."""
    results = run_world(2, ncclsafe_worlds.gpu_slow_rank_case, backend="gloo", timeout=300)
    for res in results:
        assert res["device_timing"] and res["stragglers"] == [1], res
        assert res["times"][1] > 5 * res["times"][0], res


def _hang(tmp_path: Path, *extra: str) -> tuple[int, Path]:
    run = tmp_path / "run"
    overrides = [f"run.dir={run}", "resilience.heartbeat_every_s=1", *extra]
    p = mp.get_context("spawn").Process(target=ncclsafe_worlds.nccl_hang, args=(str(tmp_path), overrides))
    t0 = time.monotonic()
    p.start()
    p.join(timeout=240)
    if p.is_alive():
        p.kill()
        pytest.fail("the hung NCCL world did not end within 240 s")
    print(f"ended with {p.exitcode} after {time.monotonic() - t0:.1f}s")
    return p.exitcode, run / "watchdog"


def test_nccl_hang_is_reported_by_the_watchdog_with_the_flight_recorder(tmp_path):
    code, out = _hang(tmp_path, "resilience.hang_timeout_s=3", "resilience.collective_timeout_s=120")
    side = torch.load(tmp_path / "side_group.pt")
    assert side["straggler"] == ([], [0.25]) and side["control_backend"] == "gloo"
    assert NO_CPU_BACKEND in side["world_cpu_error"]
    assert code == 3
    (report,) = out.glob("rank0-*.txt")
    text = report.read_text()
    print(text.split("Python stacks")[0])
    assert "megaloom watchdog: rank 0 made no progress" in text
    assert "this rank's last collective: collective #2 all_reduce_sum over ranks [0]" in text
    # the host saw the all-reduce return; the flight recorder knows the device never finished it
    assert "oldest unfinished collective: nccl:all_reduce" in text, text[:3000]
    dump = Path(text.split("flight recorder dump: ")[1].split(" (")[0])
    entries = json.loads(dump.read_text())["entries"]
    assert any(e["profiling_name"] == "nccl:all_reduce" and e["state"] != "completed" for e in entries)


def test_nccl_timeout_dumps_the_flight_recorder_into_the_run_dir(tmp_path):
    code, out = _hang(tmp_path, "resilience.hang_timeout_s=0", "resilience.collective_timeout_s=5")
    assert code != 0  # NCCL's watchdog ended the process
    dumps = [p for p in out.glob("flight_recorder_rank0*")]
    assert dumps, sorted(p.name for p in out.iterdir())
