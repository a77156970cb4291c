"""metrics.jsonl is strict JSON even when a step is not finite: null plus a `nonfinite` list, never a bare NaN;
`megaloom plot` reads such files (issue 19, fault 10)."""

import json

import pytest

from megaloom.config import load_config
from megaloom.plot import compare_runs, plot_run
from megaloom.train import train
from tests.conftest import tiny_overrides


def _strict(line: str) -> dict:
    def refuse(const):
        raise ValueError(f"not JSON: {const}")
    return json.loads(line, parse_constant=refuse)


def test_a_non_finite_step_is_logged_as_null_with_a_flag_and_plots(small_corpus, tmp_path, monkeypatch):
    monkeypatch.setenv("MEGALOOM_FAULT", "nan:step=2:count=1")  # step 2's gradients are NaN (the step is skipped)
    run = tmp_path / "m"
    train(load_config(None, tiny_overrides(small_corpus, run, "train.steps=3", "checkpoint.every=0",
                                           "checkpoint.final=false")))
    recs = [_strict(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert recs[1]["step"] == 2 and recs[1]["grad_norm"] is None and recs[1]["nonfinite"] == ["grad_norm"]
    assert "nonfinite" not in recs[0] and recs[0]["grad_norm"] > 0
    assert plot_run(run).is_file()


def test_null_losses_are_gaps_for_plot_and_compare(tmp_path):
    for name, losses in (("a", [5.0, None, 4.0]), ("b", [5.1, 4.6, None])):
        d = tmp_path / name
        d.mkdir()
        lines = [json.dumps({"step": i + 1, "loss": v, **({"nonfinite": ["loss"]} if v is None else {})})
                 for i, v in enumerate(losses)]
        (d / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    assert plot_run(tmp_path / "a").is_file()
    assert compare_runs([tmp_path / "a", tmp_path / "b"], tmp_path / "c.png").is_file()


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_sink_writes_null_and_names_the_key(tmp_path, value):
    from megaloom.observe.metrics import MetricsSink

    sink = MetricsSink(tmp_path, tensorboard=False)
    sink.log({"step": 1, "loss": value, "lr": 1e-3, "mfu": None, "compute_s_per_rank": [0.1, value]})
    rec = _strict((tmp_path / "metrics.jsonl").read_text())
    assert rec["loss"] is None and rec["compute_s_per_rank"] == [0.1, None]
    assert rec["nonfinite"] == ["loss", "compute_s_per_rank"]
