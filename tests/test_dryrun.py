"""`megaloom train --dry-run`: one rank of a large job in one process on the fake process group.

The dry runs themselves start a (fake) process group, which is process-wide state: they run in a subprocess
each, so that this pytest process stays without one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch.distributed as dist

from megaloom.cli import main
from megaloom.config import ConfigError, load_config
from megaloom.training.dryrun import SyntheticTokens, dry_run, last_stage_rank, pick_rank

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["parallel.tp=2", "parallel.pp=2", "train.micro_batch_size=1", "train.seq_len=64", "model.n_layers=4"]


def test_rank_choice_follows_the_mesh_layout() -> None:
    sizes = dict(tp=2, pp=2, cp=1, dp=16, ep=1)
    assert last_stage_rank(64, sizes) == 32  # pp outermost: the last stage is the upper half
    assert pick_rank("last-stage", 64, sizes) == 32 and pick_rank("0", 64, sizes) == 0 and pick_rank(7, 64, sizes) == 7
    assert last_stage_rank(64, sizes, "dp-cp-tp-pp") == 1  # pp innermost: ranks alternate stages
    with pytest.raises(ConfigError, match="outside the world of 64 ranks"):
        pick_rank("64", 64, sizes)
    with pytest.raises(ConfigError, match="last-stage"):
        pick_rank("middle", 64, sizes)


def test_layout_refusals_come_before_any_process_group() -> None:
    cfg = load_config(None, ["parallel.tp=3", "parallel.pp=2", "train.global_batch_size=64"])
    with pytest.raises(ConfigError, match=r"parallel\.tp\*pp\*cp = 3\*2\*1 = 6 does not divide the world size 64"):
        dry_run(cfg, 64)
    cfg = load_config(None, SMALL + ["train.global_batch_size=8"])
    with pytest.raises(ConfigError, match="train.global_batch_size=8 must be a multiple"):
        dry_run(cfg, 64)
    assert not dist.is_initialized()


def test_cli_dry_run_flags(capsys) -> None:
    assert main(["train", "--dry-run"]) == 2
    assert "--dry-run needs --world" in capsys.readouterr().err
    assert main(["train", "--world", "8"]) == 2
    assert "belong to --dry-run" in capsys.readouterr().err


def test_synthetic_tokens_are_deterministic_rows() -> None:
    ds = SyntheticTokens(10, 16, 100, seed=3)
    assert len(ds) == 10 and ds[4].shape == (17,) and ds[4].max() < 100
    assert np.array_equal(ds[4], SyntheticTokens(10, 16, 100, seed=3)[4]) and not np.array_equal(ds[4], ds[5])
    with pytest.raises(IndexError):
        ds[10]


def _dry(world: int, rank: str, overrides: list[str], steps: int = 1) -> dict:
    """A dry run in a fresh process; its report as a dict."""
    code = ("import json, sys; from megaloom.config import load_config; from megaloom.training.dryrun import dry_run;"
            f"r = dry_run(load_config(None, {overrides!r}), {world}, {rank!r}, steps={steps});"
            "print('REPORT' + json.dumps(r.as_dict(), default=str))")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("REPORT"))
    return json.loads(line[len("REPORT"):])


def _calls(report: dict, step: int = -1) -> dict:
    return {(r["group"], r["op"]): (r["calls"], r["bytes"]) for r in report["comm"][step]}


@pytest.mark.slow
def test_dry_run_of_rank_0_and_the_last_stage_of_64_ranks() -> None:
    # tp 2 x pp 2 x dp 16 = 64 ranks, 2 micro-batches of 1 x 64 tokens per rank and step (1F1B).
    over = SMALL + ["train.global_batch_size=32"]
    first = _dry(64, "0", over, steps=2)
    last = _dry(64, "last-stage", over)
    wide = _dry(128, "0", over[:-1] + ["train.global_batch_size=64"])  # dp 32, same per-rank work
    assert first["rank"] == 0 and first["coords"] == dict(pp=0, dp=0, cp=0, tp=0, ep=0)
    assert last["rank"] == 32 and last["coords"]["pp"] == 1 and last["stage"] == "last pipeline stage"
    for rep in (first, last):
        assert rep["mode"].startswith(f"{rep['steps']} training step") and len(rep["losses"]) == rep["steps"]
        plan, mem = rep["plan"], rep["memory"]
        assert mem["weights"] == plan["weights"]  # counted from this rank's parameters
        assert mem["optimizer"] == plan["optimizer"] > 0
        # Measured peaks: real tensors of about the planned size (a tiny model: the allocator's slack dominates).
        assert plan["weights"] <= mem["build_peak"] < plan["weights"] + 100e6
        assert 0.5 * plan["peak"] < mem["step_peak"] < plan["peak"] + 150e6
        assert rep["checkpoint"]["bytes"] >= mem["weights"] + mem["optimizer"]
        assert rep["seconds"]["mesh"] > 0 and rep["seconds"]["materialize"] > 0
    # Collectives per step: the same every step, and what 1F1B on 2 stages with 2 micro-batches must do.
    calls = _calls(first)
    assert calls == _calls(first, 0)
    message = 1 * 64 * 128 * 4  # micro-batch x seq x d_model, fp32
    # Megatron's scatter/gather (tp 2 without sp, parallel.pp_scatter_gather): each message crosses between the
    # stages as this tp rank's half, and the received halves are all-gathered over tp before use
    assert calls[("pp", "send")] == (2, message) and calls[("pp", "recv")] == (2, message)
    assert calls[("tp", "all_gather")] == (2, 2 * message), calls
    # the stage's gradients reduced bucket by bucket (each once per step), all of them: 4 bytes per parameter
    n_calls, n_bytes = calls[("dp/dp_cp/edp", "all_reduce_sum")]
    assert n_calls >= 1 and n_bytes == 4 * first["plan"]["setup"]["params_local"]
    assert calls[("tp", "all_reduce_sum")][0] > 0 and calls[("pp", "broadcast")][0] == 1  # the loss
    assert ("emb", "all_reduce_sum") in calls  # the tied embedding, summed over the first and last stage
    assert _calls(last)[("tp", "all_reduce_max")][0] > 0  # the vocabulary-parallel loss
    # Nothing grows with the world: doubling dp changes neither a step's collectives nor the group-creation calls
    # (one per kind of group, parallel/groups.py).
    assert _calls(wide) == calls
    assert wide["groups_created"] == first["groups_created"] <= 7


def test_profile_rank_leaves_the_fake_groups_copies_out_of_the_compute_only_mfu(tmp_path, monkeypatch) -> None:
    # profile_rank's arithmetic on CPU (the GPU path's logic): the profiled breakdown (stubbed: what an H100 trace of
    # the llama3-70b rank gave, scaled) holds the fake group's copies as their own kind; the compute-only MFU is over
    # the step less them, mfu_step over the whole step, and the summary line names both.
    from types import SimpleNamespace

    import megaloom.observe.flops as flops
    import megaloom.observe.profile as profile
    from megaloom.training.dryrun import profile_lines, profile_rank
    from megaloom.training.trainer import Trainer

    cfg = load_config(None, ["model.preset=tiny", "train.device=cpu", f"run.dir={tmp_path}/run", "train.compile=false",
                             "run.tensorboard=false"])
    trainer = Trainer(cfg).build()
    kinds = {"gemm": 70.0, profile.FAKE_GROUP_KIND: 4.0, "copy": 1.0}
    monkeypatch.setattr(profile, "profile_step", lambda *a, **k: {"busy_ms": 75.0, "kinds_ms": dict(kinds)})
    monkeypatch.setattr(profile, "kernel_count", lambda path: 123)
    monkeypatch.setattr(profile, "device_ceilings", lambda name: None)
    monkeypatch.setattr(flops, "device_peak_flops", lambda device: 1e15)
    report = SimpleNamespace(seconds={"step_1": 5.0, "step_2": 0.080, "step_3": 0.080}, losses=[0.0, 0.0, 0.0])
    prof = profile_rank(trainer, lambda: None, report, tmp_path / "profile")
    flop = prof["model_tflop"] * 1e12
    assert prof["step_ms"] == pytest.approx(80.0) and prof["fake_copy_ms"] == 4.0
    assert prof["mfu"] == pytest.approx(flop / 0.076 / 1e15) and prof["mfu_step"] == pytest.approx(flop / 0.080 / 1e15)
    summary = profile_lines(prof)[-1]
    assert "less the fake group's 4.0 ms of copies" in summary
    assert f"{100 * prof['mfu_step']:.1f}% of the whole step" in summary
