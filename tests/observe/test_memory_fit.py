"""`megaloom memory`: the plan of the worst pipeline stage and the largest micro-batch that fits a budget."""

from megaloom.cli import main
from megaloom.config import load_config
from megaloom.observe.memory_fit import HEADROOM, fit_micro_batch, resolve_for_planning, worst_stage
from megaloom.observe.memory_plan import GB


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
                                                  "parallel.pp=4", "model.n_layers=16", "train.fused_loss=true"]))
    rank, plan = worst_stage(cfg, 4)
    assert rank == 0 and plan.peak > 0


def test_cli_prints_the_plan_and_the_fit(capsys):
    assert main(["memory", "model.preset=tiny", "--gpu-gb", "1"]) == 0
    out = capsys.readouterr().out
    assert "memory plan, per rank" in out and "recompute=full" in out and "peak" in out
