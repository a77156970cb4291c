"""A full disk (issue 19, fault 6): the save's real cause is reported in one line and the run stops cleanly
(exit 1), its partial files removed; a restart resumes from the newest checkpoint; heartbeat writes that fail
never stop the watchdog thread or training; partial saves left by a crash are removed at start-up."""

import errno
import pathlib
import time

import pytest
from torch.distributed.checkpoint import CheckpointException

from megaloom.checkpoint import async_save, store
from megaloom.cli import main
from megaloom.config import load_config
from megaloom.observe.heartbeat import Heartbeat
from megaloom.resilience.watchdog import Watchdog
from megaloom.training.trainer import Trainer
from tests.conftest import tiny_overrides

BASE = ["train.steps=8", "checkpoint.every=3", "train.micro_batch_size=4"]


def _disk_fills_at_step(monkeypatch, step: int) -> None:
    """The tensor writer of that step's save writes part of a shard, then the disk is full."""
    real = store.write_tensors

    def writer(tmp, state, no_dist=False, group=None):
        if tmp.name.endswith(store.step_name(step)):
            (tmp / "__0_0.distcp").write_bytes(b"x" * 4096)
            raise OSError(errno.ENOSPC, "No space left on device", str(tmp / "__0_0.distcp"))
        return real(tmp, state, no_dist, group=group)
    monkeypatch.setattr(store, "write_tensors", writer)
    monkeypatch.setattr(async_save, "write_tensors", writer)


@pytest.mark.parametrize("async_save_", ["true", "false"])
def test_a_full_disk_stops_with_the_cause_cleans_up_and_resume_works(small_corpus, tmp_path, monkeypatch, capsys,
                                                                      async_save_):
    run = tmp_path / "r"
    args = tiny_overrides(small_corpus, run, *BASE, f"checkpoint.async_save={async_save_}")
    _disk_fills_at_step(monkeypatch, 6)
    assert main(["train", *args]) == 1
    err = capsys.readouterr().err
    stopped = [x for x in err.splitlines() if x.startswith("megaloom: stopped:")]
    assert len(stopped) == 1 and "Traceback" not in err, err[-2000:]
    assert "step_00000006 could not be written" in stopped[0] and "No space left on device" in stopped[0]
    assert "still step_00000003" in stopped[0]
    ckpts = run / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_00000003"]  # no .tmp-step_00000006

    monkeypatch.undo()  # space freed: the run resumes from step 3 and finishes
    assert main(["train", *args]) == 0
    out = capsys.readouterr().out
    assert "resumed from" in out and "step_00000003" in out
    assert (ckpts / "step_00000008").is_dir()


def test_torch_writer_errors_on_a_full_disk_name_the_real_cause(tmp_path, monkeypatch):
    # torch.save's writer turns ENOSPC into "unexpected pos N vs M", wrapped by DCP: the free space tells
    inner = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    e = CheckpointException("CheckpointException ranks:dict_keys([0])", {0: (inner, None)})
    monkeypatch.setattr(store.shutil, "disk_usage", lambda p: type("U", (), {"free": 0, "total": 2**40})())
    reason = store.save_failure_reason(e, tmp_path)
    assert reason.startswith("no space left on the device") and "unexpected pos 704 vs 598" in reason
    monkeypatch.setattr(store.shutil, "disk_usage", lambda p: type("U", (), {"free": 2**39, "total": 2**40})())
    assert store.save_failure_reason(e, tmp_path) == str(inner)  # not full: the writer's own words

    e = CheckpointException("x", {1: (OSError(errno.ENOSPC, "No space left on device"), None)})
    assert "No space left on device" in store.save_failure_reason(e, tmp_path)


def test_the_full_disk_line_gives_the_real_figures_of_the_filesystem_written(tmp_path, monkeypatch):
    """The free space and size are those of the filesystem holding the file the error names (its nearest
    existing parent: the partial directory may be gone), in units that show them: a full 20 MiB tmpfs read
    "0.0 MiB free of 0.0 GiB" (issue 46)."""
    import shutil

    gone = tmp_path / "ckpt" / ".tmp-step_00000006" / "__0_0.distcp"  # never made
    e = OSError(errno.ENOSPC, "No space left on device", str(gone))
    usage = shutil.disk_usage(tmp_path)
    reason = store.save_failure_reason(e, tmp_path / "elsewhere")
    assert f"free of {store._size(usage.total)})" in reason and "unknown" not in reason, reason
    assert store._size(usage.total) != "0.0 GiB"

    seen = []

    def small(path):
        seen.append(path)
        return type("U", (), {"free": 4096, "total": 20 * 2**20})()
    monkeypatch.setattr(store.shutil, "disk_usage", small)
    reason = store.save_failure_reason(e, tmp_path / "elsewhere")
    assert reason == "no space left on the device (No space left on device; 4.0 KiB free of 20.0 MiB)", reason
    assert seen == [tmp_path]  # the nearest existing parent of the file written, not the checkpoint root
    assert [store._size(n) for n in (0, 1023, 1024, 1536 * 2**20, 3 * 2**40)] == [
        "0 B", "1023 B", "1.0 KiB", "1.5 GiB", "3.0 TiB"]

def _failing_heartbeats(monkeypatch):
    real = pathlib.Path.write_text

    def write_text(self, *a, **k):
        if self.parent.name == "heartbeat":
            raise OSError(errno.ENOSPC, "No space left on device", str(self))
        return real(self, *a, **k)
    monkeypatch.setattr(pathlib.Path, "write_text", write_text)


def test_a_failing_heartbeat_never_stops_its_thread(tmp_path, monkeypatch, capsys):
    _failing_heartbeats(monkeypatch)
    hb = Heartbeat(tmp_path, 0, every_s=0.2).start()
    dog = Watchdog(tmp_path, 0, timeout_s=60, recorder=None, heartbeat=hb).start()
    try:
        time.sleep(0.8)  # several beats at the 0.2 s interval
        assert hb._thread.is_alive() and dog._thread.is_alive()
    finally:
        dog.stop()
        hb.stop()  # the last beat: no exception either
    assert capsys.readouterr().out.count("cannot write its heartbeat") == 1
    assert not list((tmp_path / "heartbeat").glob("*.tmp*"))


def test_training_goes_on_when_heartbeats_cannot_be_written(small_corpus, tmp_path, monkeypatch, capsys):
    _failing_heartbeats(monkeypatch)
    args = tiny_overrides(small_corpus, tmp_path / "h", "train.steps=4", "checkpoint.every=0")  # the loop's beats
    assert main(["train", *args]) == 0
    assert capsys.readouterr().out.count("cannot write its heartbeat") == 1


def test_partial_saves_are_removed_at_start_up(small_corpus, tmp_path):
    run = tmp_path / "s"
    stale = run / "checkpoints" / ".tmp-step_00000020"
    stale.mkdir(parents=True)
    (stale / "__0_0.distcp").write_bytes(b"x" * 1000)
    trainer = Trainer(load_config(None, tiny_overrides(small_corpus, run, "train.steps=2"))).build()
    try:
        assert not stale.exists()  # before any save: on a full disk these bytes are what keeps it full
    finally:
        trainer.fit()


def test_a_full_disk_elsewhere_in_the_run_dir_is_one_line(small_corpus, tmp_path, monkeypatch, capsys):
    from megaloom.observe.metrics import MetricsSink

    def full(self, record):
        raise OSError(errno.ENOSPC, "No space left on device", str(self.path))
    monkeypatch.setattr(MetricsSink, "log", full)
    args = tiny_overrides(small_corpus, tmp_path / "m", "train.steps=2", "checkpoint.every=0")
    assert main(["train", *args]) == 1
    err = capsys.readouterr().err
    assert "megaloom: stopped: no space left on the device writing" in err and "metrics.jsonl" in err
    assert "Traceback" not in err
