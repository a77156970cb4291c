"""Rollbacks past non-finite steps are bounded: a run that diverges whatever data it reads stops with one line and
exit 1 instead of rolling back forever (issue 19, fault 1)."""

from megaloom.cli import main
from megaloom.config import load_config
from megaloom.train import train
from tests.conftest import tiny_overrides

BASE = ["train.steps=8", "train.micro_batch_size=4", "checkpoint.every=3", "checkpoint.async_save=false"]


def test_lr_too_high_after_resume_stops_instead_of_rolling_back_forever(small_corpus, tmp_path, capsys):
    run = tmp_path / "lr"
    train(load_config(None, tiny_overrides(small_corpus, run, *BASE)), stop_after=6)  # checkpoints 3 and 6
    capsys.readouterr()
    args = tiny_overrides(small_corpus, run, *BASE, "train.steps=40", "train.lr=1e6")
    rc = main(["train", *args])
    captured = capsys.readouterr()
    assert rc == 1, captured.err[-2000:]
    err = [x for x in captured.err.splitlines() if x.startswith("megaloom: stopped:")]
    assert len(err) == 1 and "diverged again" in err[0] and "not the cause" in err[0] and "train.lr" in err[0], \
        captured.err[-2000:]
    assert captured.out.count("ROLLBACK") == 1  # one rollback tried on new data, then the stop
    assert "Traceback" not in captured.err
    assert "step 6" in err[0] and (run / "checkpoints" / "step_00000006").is_dir()


def test_max_rollbacks_bounds_rollbacks_on_distinct_bad_windows(small_corpus, tmp_path, monkeypatch, capsys):
    # data windows 5..7 and 12..14 are bad: the first rollback (to step 3, data offset 4) passes step 7, the second
    # window then arrives at steps 8..10, beyond the first: a second rollback would be allowed but the budget is 1
    monkeypatch.setenv("MEGALOOM_FAULT", "nan:step=5:count=3;nan:step=12:count=3")
    args = tiny_overrides(small_corpus, tmp_path / "b1", *BASE, "train.steps=16", "resilience.max_rollbacks=1")
    rc = main(["train", *args])
    captured = capsys.readouterr()
    assert rc == 1
    assert captured.out.count("ROLLBACK") == 1
    assert "resilience.max_rollbacks=1" in captured.err and "already rolled back 1 time" in captured.err

    # the same faults with a budget of 2: both windows are rolled back and the run finishes
    args = tiny_overrides(small_corpus, tmp_path / "b2", *BASE, "train.steps=16", "resilience.max_rollbacks=2")
    assert main(["train", *args]) == 0
    assert capsys.readouterr().out.count("ROLLBACK") == 2


def test_non_finite_steps_with_no_checkpoint_stop_with_one_line(small_corpus, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MEGALOOM_FAULT", "nan:step=1:count=3")
    rc = main(["train", *tiny_overrides(small_corpus, tmp_path / "n", *BASE)])
    err = capsys.readouterr().err
    assert rc == 1 and "no checkpoint" in err and "to roll back to" in err and "Traceback" not in err, err[-2000:]

