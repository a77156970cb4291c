"""`megaloom memory`: the plan of the worst pipeline stage and the largest micro-batch that fits a budget."""

import copy

import pytest

from megaloom.cli import main
from megaloom.config import ConfigError, load_config
from megaloom.parallel.mesh import validate_layout
from megaloom.planning.memory_fit import (
    HEADROOM,
    auto_micro_batch,
    fit_micro_batch,
    resolve_for_planning,
    worst_stage,
)
from megaloom.planning.memory_plan import GB


def test_fit_orders_recompute_modes_and_respects_the_budget():
    cfg = resolve_for_planning(load_config(None, ["model.preset=llama3-1b", "train.seq_len=4096",
                                                  "train.micro_batch_size=1", "train.global_batch_size=1"]))
    rows = {r["recompute"]: r for r in fit_micro_batch(cfg, 1, 80, max_micro=16)}
    assert rows["none"]["micro_batch"] <= rows["selective"]["micro_batch"] <= rows["full"]["micro_batch"]
    assert all(r["peak_gb"] <= HEADROOM * 80 * 1e9 / GB for r in rows.values())
    # one more micro-batch than the answer would not fit
    for mode, r in rows.items():
        if r["micro_batch"] < 16:
            more = fit_micro_batch(cfg, 1, 80, modes=(mode,), max_micro=r["micro_batch"] + 1)[0]
            assert more["micro_batch"] == r["micro_batch"]


def test_first_pipeline_stage_is_the_worst_with_1f1b():
    cfg = resolve_for_planning(load_config(None, ["model.preset=llama3-1b", "train.seq_len=2048",
                                                  "train.micro_batch_size=1", "train.global_batch_size=8",
                                                  "parallel.pp=4", "model.n_layers=16", "train.fused_loss=true",
                                                  "train.compile=false"]))  # eager save-sets: 1F1B in flight
    rank, plan = worst_stage(cfg, 4)
    assert rank == 0 and plan.peak > 0


def test_cli_prints_the_plan_and_the_fit(capsys):
    assert main(["memory", "model.preset=tiny", "--gpu-gb", "1"]) == 0
    out = capsys.readouterr().out
    assert "memory plan, per rank" in out and "recompute=full" in out and "peak" in out


def test_auto_micro_batch_takes_the_largest_divisor_that_fits():
    cfg = resolve_for_planning(load_config(None, ["model.preset=llama3-1b-untied", "train.seq_len=4096",
                                                  "train.micro_batch_size=0", "train.global_batch_size=24",
                                                  "train.precision=bf16"]))

    def peak(mb: int) -> float:
        trial = copy.deepcopy(cfg)
        trial.train.micro_batch_size = mb
        return worst_stage(trial, 1)[1].peak / GB

    # a budget between the plans of micro-batch 6 and 8: 6 (24's largest divisor under it), not 7 (no divisor)
    budget = (peak(6) + peak(8)) / 2 / HEADROOM
    mb, planned = auto_micro_batch(cfg, 1, budget)
    assert (mb, round(planned, 6)) == (6, round(peak(6), 6))
    assert auto_micro_batch(cfg, 2, None) == (6, None)  # no limit known (CPU): 12's largest divisor up to 8
    assert auto_micro_batch(cfg, 4, None) == (6, None) and auto_micro_batch(cfg, 6, None) == (4, None)
    with pytest.raises(ConfigError, match="even micro-batch 1"):
        auto_micro_batch(cfg, 1, peak(1) * 0.5)


def test_auto_micro_batch_config_rules():
    cfg = load_config(None, ["train.micro_batch_size=0", "train.global_batch_size=6"])
    assert validate_layout(cfg, 2)["dp"] == 2
    with pytest.raises(ConfigError, match="global_batch_size=6 must be a multiple"):
        validate_layout(cfg, 4)
    with pytest.raises(ConfigError, match="micro_batch_size=0 .auto. with parallel.pp=2"):
        load_config(None, ["train.micro_batch_size=0", "parallel.pp=2"])
    with pytest.raises(ConfigError, match="train.micro_batch_size must be >= 0"):
        load_config(None, ["train.micro_batch_size=-1"])


def test_fit_tries_the_fused_loss_and_no_accumulation_and_says_so(capsys):
    """Issue 24 (5): llama3-8b at 8192 on 141 GB fits only with full recompute, the fused loss and one
    micro-batch per step; the planner used to answer "does not fit" for every mode (README said micro-batch 3)."""
    assert main(["memory", "--gpu-gb", "141", "model.preset=llama3-8b", "train.seq_len=8192",
                 "train.fused_loss=false", "train.micro_batch_size=8", "train.recompute_casts=false",
                 "train.bf16_residual=false"]) == 0  # (auto's bf16 stream halves full recompute's saved inputs)
    out = capsys.readouterr().out
    assert "as configured: 2 micro-batch(es) per step, train.fused_loss=false" in out
    full = next(line for line in out.splitlines() if "recompute=full" in line and "micro-batch" in line)
    assert "micro-batch 3" in full and "with train.fused_loss=true, 1 micro-batch per step" in full
    assert "recompute=none       does not fit" in out


def test_fit_as_configured_suggests_no_change():
    cfg = resolve_for_planning(load_config(None, ["model.preset=llama3-1b", "train.seq_len=2048",
                                                  "train.micro_batch_size=1", "train.global_batch_size=2",
                                                  "train.fused_loss=false"]))
    rows = fit_micro_batch(cfg, 1, 141, modes=("full",), max_micro=4)
    assert rows[0]["micro_batch"] == 4 and not rows[0]["fused_loss"] and rows[0]["micro_batches"] == 2


def test_micro_batch_not_given_is_chosen_by_the_plan():
    """Not given (and no pipeline): auto, so `megaloom train model.preset=... train.global_batch_size=3` works; on
    CPU auto is at most 8 (what runs always used). Given, or with pipelines (8 when not given), it stays."""
    assert load_config(None, []).train.micro_batch_size == 0
    assert load_config(None, ["train.global_batch_size=3"]).train.micro_batch_size == 0
    assert load_config(None, ["train.micro_batch_size=8"]).train.micro_batch_size == 8
    assert load_config(None, ["parallel.pp=2", "model.n_layers=4"]).train.micro_batch_size == 8
    assert auto_micro_batch(resolve_for_planning(load_config(None, [])), 1, None) == (8, None)  # 16 per step


def test_cli_memory_resolves_an_auto_micro_batch(capsys):
    assert main(["memory", "train.micro_batch_size=0", "train.global_batch_size=12"]) == 0
    assert "train.micro_batch_size=0 (auto) -> 6 (no --gpu-gb: at most 8)" in capsys.readouterr().out


def test_memory_command_says_what_recompute_casts_auto_chose(capsys):
    assert main(["memory", "--gpu-gb", "141", "model.preset=llama3-8b", "train.seq_len=8192",
                 "train.global_batch_size=1"]) == 0
    out = capsys.readouterr().out
    assert "train.recompute_casts=auto -> true (micro-batch 1 planned at" in out
    assert "compiled blocks: the partitioner's save-set (train.recompute_casts: the lean one)" in out
