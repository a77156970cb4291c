"""run.trackers: TensorBoard, W&B (offline) and MLflow (its default SQLite store in the run directory, and a file
store where MLFLOW_ALLOW_FILE_STORE allows it) mirror metrics.jsonl; a tracker that cannot start is an error before
the first step unless run.trackers_optional=true (then a warning), and one that fails later warns once and training
goes on. No network: wandb runs with WANDB_MODE=offline, MLflow on local stores. The W&B and MLflow tests skip
where those packages are not installed (CI installs `.[dev]` only)."""

from __future__ import annotations

import json
import struct
import sys
import time
from pathlib import Path

import pytest

from megaloom.config import ConfigError, load_config
from megaloom.observe.metrics import MetricsSink, read_metrics
from megaloom.train import train
from tests.conftest import tiny_overrides

RECORDS = [{"step": s, "loss": 3.0 / s, "lr": 1e-3 * s, "grad_norm": 0.5, "tokens_per_s": 100.0 * s, "mfu": None,
            "compute_s_per_rank": [0.1, 0.2], "eval_loss": float("nan") if s == 2 else 1.0 / s} for s in (1, 2, 3)]


def expected(record: dict) -> dict:
    """What a tracker receives of a record: its finite numbers, under metrics.jsonl's keys."""
    return {k: v for k, v in record.items() if k != "step" and isinstance(v, int | float) and v == v}


def test_unknown_tracker_is_a_config_error():
    with pytest.raises(ConfigError, match="run.trackers: 'wandbb'.*Did you mean 'wandb'"):
        load_config(None, ["run.trackers=tensorboard,wandbb"])
    assert load_config(None, []).run.trackers == ["tensorboard"]  # the default: today's behaviour


def test_failing_trackers_warn_once_and_training_goes_on(small_corpus, tmp_path, monkeypatch, capsys):
    """wandb missing (its import fails) and a tracker that raises at its second record: one warning line each,
    every step trained, metrics.jsonl complete."""
    from megaloom.observe import trackers

    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError, installed or not
    calls = []

    class Flaky:
        def log(self, record, step):
            calls.append(step)
            if len(calls) == 2:
                raise OSError("disk full")

        def close(self):
            pass

    real = trackers._opener
    monkeypatch.setattr(trackers, "_opener", lambda name, *a: (lambda: Flaky()) if name == "mlflow"
                        else real(name, *a))
    run = tmp_path / "run"
    res = train(load_config(None, tiny_overrides(small_corpus, run, "train.steps=4", "checkpoint.every=0",
                                                 "run.trackers=tensorboard,wandb,mlflow", "run.tensorboard=true",
                                                 "run.trackers_optional=true")))
    assert res.final_step == 4
    out = capsys.readouterr().out
    assert out.count("run.trackers: wandb is not installed") == 1 and "pip install 'megaloom[wandb]'" in out
    assert out.count("run.trackers: mlflow failed at step 2 (OSError: disk full)") == 1
    assert calls == [1, 2]  # disabled after its failure
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3, 4]
    assert list(run.glob("events.out.tfevents.*"))  # the tracker that works still writes


class Refuses:
    """A tracker whose start fails, as MLflow's on a store it refuses or a server that does not answer."""

    closed: list[str] = []

    def __init__(self, *args) -> None:
        raise RuntimeError("store refused\nsecond line")


class Works:
    def __init__(self) -> None:
        Refuses.closed.clear()

    def log(self, record, step):
        pass

    def close(self):
        Refuses.closed.append("works")


def _fake_openers(monkeypatch):
    from megaloom.observe import trackers

    monkeypatch.setattr(trackers, "_opener", lambda name, *a: {"wandb": Works, "mlflow": Refuses}[name])


def test_a_tracker_that_cannot_start_stops_the_run_before_its_first_step(small_corpus, tmp_path, monkeypatch,
                                                                         capsys):
    """Issue 49: a tracker that fails to start (a fake one here) is one line naming it, the cause and the way out,
    exit 2, before any step; the trackers started before it are closed; the failed start leaves no .lock."""
    from megaloom.cli import main

    _fake_openers(monkeypatch)
    run = tmp_path / "run"
    args = tiny_overrides(small_corpus, run, "train.steps=2", "checkpoint.every=0", "run.trackers=wandb,mlflow")
    with pytest.raises(ConfigError) as err:
        train(load_config(None, args))
    assert str(err.value) == ("run.trackers: mlflow failed to start (RuntimeError: store refused); or set "
                              "run.trackers_optional=true to train without it (metrics.jsonl has every record)")
    assert Refuses.closed == ["works"]
    assert not (run / "metrics.jsonl").exists() and not (run / ".lock").exists()
    capsys.readouterr()
    assert main(["train", *args]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("megaloom: error: run.trackers: mlflow failed to start (RuntimeError: store refused)")

    monkeypatch.undo()  # the real openers: a tracker not installed is the same error, with the pip line
    monkeypatch.setitem(sys.modules, "mlflow", None)
    with pytest.raises(ConfigError, match=r"run.trackers: mlflow is not installed .*pip install 'megaloom\[mlflow\]'"
                                          r".*run.trackers_optional=true"):
        MetricsSink(tmp_path / "s", tensorboard=False, trackers=["mlflow"])


def test_optional_trackers_that_cannot_start_warn_and_the_run_trains(small_corpus, tmp_path, monkeypatch, capsys):
    _fake_openers(monkeypatch)
    run = tmp_path / "run"
    res = train(load_config(None, tiny_overrides(small_corpus, run, "train.steps=2", "checkpoint.every=0",
                                                 "run.trackers=wandb,mlflow", "run.trackers_optional=true")))
    assert res.final_step == 2 and [r["step"] for r in read_metrics(run)] == [1, 2]
    out = capsys.readouterr().out
    assert out.count("WARNING: run.trackers: mlflow failed to start (RuntimeError: store refused); training goes "
                     "on without it") == 1


def test_tensorboard_off_by_either_setting(tmp_path):
    sink = MetricsSink(tmp_path / "a", tensorboard=False, trackers=["tensorboard"])
    assert sink.trackers == []
    (tmp_path / "b").mkdir()
    sink = MetricsSink(tmp_path / "b", tensorboard=True)
    sink.log(RECORDS[0])
    sink.close()
    assert list((tmp_path / "b").glob("events.out.tfevents.*"))


def _wandb_history(run_dir: Path) -> list[dict]:
    """The history rows of an offline run, read from its .wandb file: a LevelDB-style log (a 7-byte header, then
    chunks of crc32 / length / type + payload) of wandb's protobuf Records; written by wandb's service process,
    which may finish after `finish()` returns, so it is polled for the exit record."""
    from wandb.proto import wandb_internal_pb2 as pb

    for _ in range(100):
        files = list(run_dir.glob("wandb/offline-run-*/*.wandb"))
        rows, done = [], False
        if files:
            data, pos, buf = files[0].read_bytes(), 7, b""
            while pos + 7 <= len(data):
                _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
                buf, pos = buf + data[pos + 7:pos + 7 + n], pos + 7 + n
                if kind in (1, 4):  # a full record, or the last chunk of one
                    rec = pb.Record()
                    rec.ParseFromString(buf)
                    buf = b""
                    which = rec.WhichOneof("record_type")
                    done |= which == "exit"
                    if which == "history":
                        rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                                     for i in rec.history.item})
        if done:
            return rows
        time.sleep(0.1)
    raise AssertionError(f"no finished offline wandb run under {run_dir}")


def test_wandb_offline_mirrors_metrics(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    run = tmp_path / "run"
    run.mkdir()
    sink = MetricsSink(run, tensorboard=False, trackers=["wandb"], config={"train": {"lr": 1e-3}})
    assert sink.trackers[0].active
    for r in RECORDS:
        sink.log(r)
    sink.close()
    rows = _wandb_history(run)
    assert [row["_step"] for row in rows] == [1, 2, 3]
    for row, r in zip(rows, RECORDS, strict=True):
        assert {k: v for k, v in row.items() if not k.startswith("_")} == pytest.approx(expected(r))


def test_mlflow_file_store_mirrors_metrics_and_resumes_its_run(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow >= 3.17 asks for a database unless told so
    uri = f"file:{tmp_path / 'mlruns'}"
    run = tmp_path / "run"
    run.mkdir()
    for part in (RECORDS[:2], RECORDS[2:]):  # a resumed megaloom run logs into the MLflow run it started
        sink = MetricsSink(run, tensorboard=False, trackers=["mlflow"], config={"train": {"lr": 1e-3}},
                           project="sft", mlflow_uri=uri)
        assert sink.trackers[0].active
        for r in part:
            sink.log(r)
        sink.close()
    client = MlflowClient(uri)
    (found,) = client.search_runs([client.get_experiment_by_name("sft").experiment_id])
    assert found.info.status == "FINISHED" and found.data.params == {"train.lr": "0.001"}
    for key in expected(RECORDS[0]):
        history = sorted((m.step, m.value) for m in client.get_metric_history(found.info.run_id, key))
        assert history == pytest.approx([(r["step"], r[key]) for r in RECORDS if key in expected(r)]), key


def test_mlflow_default_store_is_a_sqlite_database_in_the_run_directory(tmp_path, monkeypatch):
    """Issue 49: run.mlflow_uri empty (and no MLFLOW_TRACKING_URI) logs into sqlite:///<run.dir>/mlflow.db, which
    current MLflow accepts (its file store it refuses); artifacts under run.dir, nothing in the working directory."""
    pytest.importorskip("mlflow")
    pytest.importorskip("sqlalchemy")
    pytest.importorskip("alembic")
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    for part in (RECORDS[:2], RECORDS[2:]):  # resumed: the same MLflow run
        sink = MetricsSink(run, tensorboard=False, trackers=["mlflow"], config={"train": {"lr": 1e-3}}, project="p")
        assert sink.trackers[0].active
        for r in part:
            sink.log(r)
        sink.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    client = MlflowClient(f"sqlite:///{run / 'mlflow.db'}")
    exp = client.get_experiment_by_name("p")
    assert exp.artifact_location == (run / "mlartifacts").as_uri()
    (found,) = client.search_runs([exp.experiment_id])
    assert found.info.status == "FINISHED" and found.data.params == {"train.lr": "0.001"}
    history = sorted((m.step, m.value) for m in client.get_metric_history(found.info.run_id, "loss"))
    assert history == pytest.approx([(r["step"], r["loss"]) for r in RECORDS])


def test_mlflow_file_store_refused_by_mlflow_names_the_fix(tmp_path, monkeypatch):
    """run.mlflow_uri=file:... on an MLflow that refuses its file store: one line with the ways out."""
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    uri = f"file:{tmp_path / 'mlruns'}"
    try:
        mlflow.tracking.MlflowClient(uri).get_experiment_by_name("x")
    except Exception as e:
        if "maintenance" not in str(e):
            raise
    else:
        pytest.skip(f"mlflow {mlflow.__version__} still accepts its file store")
    with pytest.raises(ConfigError) as err:
        MetricsSink(tmp_path, tensorboard=False, trackers=["mlflow"], mlflow_uri=uri)
    msg = str(err.value)
    assert msg.startswith(f"run.trackers: mlflow failed to start (RuntimeError: run.mlflow_uri={uri} is MLflow's file "
                          "store, which current MLflow refuses"), msg
    assert "MLFLOW_ALLOW_FILE_STORE=true" in msg and "run.trackers_optional=true" in msg
