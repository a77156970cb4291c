"""One run per run.dir (issue 19, fault 7): a second run is refused with a message naming the first (pid, host),
before it writes anything there; the lock goes with the holding process, so a restart after a crash proceeds."""

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap

import pytest

from megaloom.cli import main
from megaloom.config import load_config
from megaloom.resilience.run_lock import RunDirLocked, lock_run_dir
from megaloom.train import train
from tests.conftest import tiny_overrides

BASE = ["train.steps=2", "checkpoint.every=0", "checkpoint.final=false"]


@pytest.fixture
def holder(tmp_path):
    """Another process holding the lock of tmp_path/run, as rank 0 of a live run does."""
    run = tmp_path / "run"
    code = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from megaloom.resilience.run_lock import lock_run_dir
        lock_run_dir(Path({str(run)!r}))
        print("locked", flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=os.getcwd()))
    assert proc.stdout.readline().strip() == "locked"
    yield run, proc
    proc.kill()
    proc.wait()


def test_a_second_run_is_refused_naming_the_first_and_writes_nothing(small_corpus, holder, capsys):
    run, proc = holder
    with pytest.raises(RunDirLocked) as err:
        train(load_config(None, tiny_overrides(small_corpus, run, *BASE)))
    msg = str(err.value)
    assert f"pid {proc.pid} on host {socket.gethostname()}" in msg and "another run.dir" in msg
    assert sorted(p.name for p in run.iterdir()) == [".lock"]  # no config.yaml, metrics, checkpoints
    assert json.loads((run / ".lock").read_text())["pid"] == proc.pid

    rc = main(["train", *tiny_overrides(small_corpus, run, *BASE)])  # the command: one line, exit 2
    err_text = capsys.readouterr().err
    assert rc == 2 and f"pid {proc.pid}" in err_text and "Traceback" not in err_text
    rc = main(["train", "--nproc", "2", *tiny_overrides(small_corpus, run, *BASE)])  # refused before torchrun
    assert rc == 2 and f"pid {proc.pid}" in capsys.readouterr().err


def _unwritable_dir(tmp_path):
    """A directory this process cannot write: a read-only one (mode 0555), or for root, whom modes do not stop,
    sysfs's /sys/kernel (no file can be created there, not even by root)."""
    from pathlib import Path

    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(0o555)
    return d if not os.access(d, os.W_OK) else Path("/sys/kernel")


@pytest.mark.parametrize("nproc", [[], ["--nproc", "2"]])
def test_a_read_only_run_dir_is_one_line_before_any_work(small_corpus, tmp_path, capsys, monkeypatch, nproc):
    from megaloom.parallel import launch

    monkeypatch.setattr(launch, "run_torchrun", lambda *a, **k: pytest.fail("torchrun started"))
    ro, cache = _unwritable_dir(tmp_path), tmp_path / "cache"
    rc = main(["train", *nproc, *tiny_overrides(small_corpus, ro, *BASE, f"data.cache_dir={cache}")])
    (line,) = capsys.readouterr().err.splitlines()
    assert rc == 2, line
    assert line.startswith(f"megaloom: error: run.dir {ro} cannot be written: ") and "set run.dir to a" in line, line
    assert not cache.exists()  # refused before the data was opened (its sample indices are cached there)


def test_the_lock_goes_with_a_killed_holder(small_corpus, holder):
    run, proc = holder
    proc.send_signal(signal.SIGKILL)  # a crash: no clean-up ran
    proc.wait()
    res = train(load_config(None, tiny_overrides(small_corpus, run, *BASE)))
    assert res.final_step == 2
    assert json.loads((run / ".lock").read_text())["pid"] == os.getpid()


def test_one_process_may_build_several_trainers_in_turn_and_releases(tmp_path):
    run = tmp_path / "r"
    code = ("from pathlib import Path; from megaloom.resilience.run_lock import lock_run_dir; "
            f"lock_run_dir(Path({str(run)!r}))")

    def other_process_locks() -> bool:
        return subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=os.getcwd()),
                              capture_output=True).returncode == 0

    a = lock_run_dir(run)
    b = lock_run_dir(run)  # re-entrant in one process
    a.release()
    assert not other_process_locks()  # b still holds it
    b.release()
    assert other_process_locks()


def test_torchrun_ranks_share_the_run_and_rank_0_restarts_after_a_kill(small_corpus, tmp_path):
    from tests.resilience.test_recovery import launch

    run = tmp_path / "k"
    proc = launch(tiny_overrides(small_corpus, run, "train.steps=6", "checkpoint.every=3", "train.micro_batch_size=2",
                                  "checkpoint.async_save=false"),
                  fault="kill:rank=0:step=5")  # rank 0, the lock holder, dies; torchrun restarts the job
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stdout and "in use by another" not in proc.stdout + proc.stderr
