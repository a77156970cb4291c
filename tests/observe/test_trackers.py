"""run.trackers: TensorBoard, W&B (offline) and MLflow (a local file store) mirror metrics.jsonl; a tracker that
fails warns once and training goes on. No network: wandb runs with WANDB_MODE=offline, MLflow on file:<tmp>.
The W&B and MLflow tests skip where those packages are not installed (CI installs `.[dev]` only)."""

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
                                                 "run.trackers=tensorboard,wandb,mlflow", "run.tensorboard=true")))
    assert res.final_step == 4
    out = capsys.readouterr().out
    assert out.count("run.trackers: wandb is not installed") == 1 and "pip install 'megaloom[wandb]'" in out
    assert out.count("run.trackers: mlflow failed at step 2 (OSError: disk full)") == 1
    assert calls == [1, 2]  # disabled after its failure
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3, 4]
    assert list(run.glob("events.out.tfevents.*"))  # the tracker that works still writes


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
