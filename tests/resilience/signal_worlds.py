"""What the ranks of a gloo world run for tests/resilience/test_signals.py: stop requests agreed over ranks."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from megaloom.config import load_config
from megaloom.parallel.host_group import HostGroup
from megaloom.resilience.signals import StopRequests
from megaloom.runtime import Runtime
from megaloom.training.trainer import Trainer
from tests.conftest import tiny_overrides


def _losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


def _timeouts(trainer: Trainer) -> list[float]:
    """Seconds of the timeout of the world group and every training group of ``trainer`` (CPU: gloo)."""
    import torch
    import torch.distributed as dist

    groups = [dist.group.WORLD, *trainer.mesh.training_groups()]
    return [g._get_backend(torch.device("cpu")).options._timeout.total_seconds() for g in groups]


def _train(overrides: list[str], rank: int, world: int, device, fault: str = ""):
    os.environ["MEGALOOM_FAULT"] = fault
    try:
        return Trainer(load_config(None, overrides), runtime=Runtime(device, rank, world, rank)).build().fit()
    finally:
        os.environ["MEGALOOM_FAULT"] = ""


def signal_suite(rank: int, world: int, device, corpus: dict, root: str, base: list[str]) -> dict:
    """An uninterrupted run; a run whose rank 1 alone gets SIGTERM at the start of step 3, then resumed; the
    per-step cost of the agreement. Run directories under ``root``."""
    ref, cut = Path(root) / "ref", Path(root) / "cut"

    def overrides_of(run_dir: Path) -> list[str]:
        return tiny_overrides(corpus, run_dir, *base)

    out: dict = {}
    # The uninterrupted run, with the process-group timeouts read before and after its first step.
    t = Trainer(load_config(None, overrides_of(ref) + ["resilience.collective_timeout_s=1000",
                                                       "resilience.init_timeout_s=3000"]),
                runtime=Runtime(device, rank, world, rank)).build()
    out["timeouts_built"] = _timeouts(t)
    end_start_up = t._end_start_up_timeouts

    def spy() -> None:
        before = _timeouts(t)
        end_start_up()
        out["timeouts_step1"] = (t.step, before, _timeouts(t))

    t._end_start_up_timeouts = spy
    t.fit()
    stopped = _train(overrides_of(cut), rank, world, device, fault="signal:rank=1:step=3:sig=15")
    out["stopped_by"], out["stopped_at"] = stopped.stopped_by, stopped.final_step
    ckpts = cut / "checkpoints"
    out["latest"] = (ckpts / "latest").read_text().strip()
    resumed = _train(overrides_of(cut), rank, world, device)
    out["resumed_to"] = resumed.final_step
    if rank == 0:
        out["ref_losses"], out["cut_losses"] = _losses(ref), _losses(cut)
    # The agreement alone, at two check intervals: rank 1 records SIGTERM during step 3.
    control = HostGroup(60.0)
    for every in (1, 3):
        stops = StopRequests(True, control, check_every=every)
        out[f"agreed_at_every{every}"] = None
        for step in range(1, 20):
            if rank == 1 and step == 3:
                stops.received = signal.SIGTERM
            if stops.poll(step) is not None:
                out[f"agreed_at_every{every}"] = step
                break
        stops.close()
    # Cost of one poll in the loop (issue this boundary's all-reduce, wait for the previous one, finished
    # during the "step"): a 2 ms step stands in for training.
    stops = StopRequests(True, control)
    polls = []
    for step in range(50):
        time.sleep(0.002)
        t0 = time.perf_counter()
        stops.poll(step)
        polls.append(time.perf_counter() - t0)
    stops.close()
    out["poll_s"] = sorted(polls)[len(polls) // 2]
    return out
