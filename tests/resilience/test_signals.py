"""SIGTERM / SIGUSR1 / Ctrl-C: every rank saves the same step, the run stops with one line, and the resumed run's
losses are bit-equal to an uninterrupted run's (resilience.save_on_signal)."""

import json
import re
import signal
import subprocess
import sys

import pytest

from megaloom.config import load_config
from megaloom.train import train
from tests.conftest import tiny_overrides, wait_for_step
from tests.parallel.harness import run_world
from tests.resilience.signal_worlds import signal_suite

BASE = ["train.steps=8", "train.micro_batch_size=2", "checkpoint.every=5", "train.log_every=1"]


def losses(run_dir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1, signal.SIGINT])
def test_a_signal_saves_the_step_reached_and_resume_is_bit_equal(small_corpus, tmp_path, monkeypatch, sig):
    before = signal.getsignal(sig)
    ref = losses(train(load_config(None, tiny_overrides(small_corpus, tmp_path / "ref", *BASE))).run_dir)
    cut = tmp_path / "cut"
    monkeypatch.setenv("MEGALOOM_FAULT", f"signal:step=3:sig={int(sig)}")
    res = train(load_config(None, tiny_overrides(small_corpus, cut, *BASE)))
    assert res.stopped_by == sig.name and res.final_step == 3  # one process: stops at the boundary it arrived in
    assert (cut / "checkpoints" / "latest").read_text().strip() == "step_00000003"
    assert signal.getsignal(sig) == before  # the handler is given back when the run ends
    monkeypatch.setenv("MEGALOOM_FAULT", "")
    assert train(load_config(None, tiny_overrides(small_corpus, cut, *BASE))).final_step == 8
    got = losses(cut)
    assert sorted(got) == list(range(1, 9))
    assert got == ref  # bit-equal: the same floats, not close ones


def test_save_on_signal_false_leaves_the_signal_alone(small_corpus, tmp_path, monkeypatch):
    monkeypatch.setenv("MEGALOOM_FAULT", "signal:step=3:sig=2")
    # Python's own Ctrl-C handler, whatever this process inherited: a shell starts a background job (`pytest &`,
    # nohup) with SIGINT ignored, and an ignored signal would not reach the run at all.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):  # Ctrl-C as without megaloom: no save, no stop request
            train(load_config(None, tiny_overrides(small_corpus, tmp_path / "r", *BASE,
                                                   "resilience.save_on_signal=false")))
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # left alone, as it was found
    finally:
        signal.signal(signal.SIGINT, previous)
    assert not (tmp_path / "r" / "checkpoints" / "latest").exists()


def test_sigterm_from_outside_exits_0_with_one_line_after_saving(small_corpus, tmp_path):
    run = tmp_path / "run"
    p = subprocess.Popen([sys.executable, "-m", "megaloom", "train",
                          *tiny_overrides(small_corpus, run, "train.steps=100000", "checkpoint.every=0")],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_step(p, 2, 100000)
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, err
    assert "Traceback" not in err, err
    lines = [x for x in err.splitlines() if x.startswith("megaloom:")]
    assert len(lines) == 1, err
    m = re.fullmatch(r"megaloom: stopped by SIGTERM at step (\d+); the last checkpoint is step (\d+) \(.*\)", lines[0])
    assert m and m[1] == m[2], lines  # checkpoint.every=0: the only checkpoint is the one the signal asked for


def test_a_signal_to_one_rank_stops_every_rank_at_the_same_saved_step(small_corpus, tmp_path):
    r0, r1 = run_world(2, signal_suite, small_corpus, str(tmp_path), BASE, timeout=400)
    # The signal reached rank 1 during step 3; the ranks agreed at the next boundary and both saved step 4.
    assert r0["stopped_by"] == r1["stopped_by"] == "SIGTERM"
    assert r0["stopped_at"] == r1["stopped_at"] == 4
    assert r0["latest"] == r1["latest"] == "step_00000004"
    assert r0["resumed_to"] == r1["resumed_to"] == 8
    for r in (r0, r1):  # the harness's world (120 s) and the mesh's groups at the start-up timeout until step 1
        assert r["timeouts_built"][0] == 120 and set(r["timeouts_built"][1:]) == {3000}, r["timeouts_built"]
        step, before, after = r["timeouts_step1"]
        assert step == 1 and before == r["timeouts_built"] and set(after) == {1000}, r["timeouts_step1"]
    assert sorted(r0["cut_losses"]) == list(range(1, 9)) and r0["cut_losses"] == r0["ref_losses"]
    # resilience.signal_check_every=3: checks at steps 3, 6, ...: issued at 3 with the record, agreed at 6
    assert r0["agreed_at_every1"] == r1["agreed_at_every1"] == 4
    assert r0["agreed_at_every3"] == r1["agreed_at_every3"] == 6
    print(f"stop-request poll per step (2 gloo ranks): median {r0['poll_s'] * 1e6:.0f} us")


def _processes_of(run_dir) -> list[int]:
    """PIDs whose command line names ``run_dir``: the launcher, torchrun and the workers of that run."""
    from pathlib import Path

    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and str(run_dir).encode() in (proc / "cmdline").read_bytes():
                found.append(int(proc.name))
        except OSError:  # gone meanwhile
            pass
    return found


def _gone_within(run_dir, seconds: float) -> list[int]:
    import time

    deadline = time.monotonic() + seconds
    while (alive := _processes_of(run_dir)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return alive


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process death signal is Linux's")
@pytest.mark.parametrize("how", ["SIGTERM", "SIGUSR1", "kill9_group"])
def test_killing_the_nproc_launcher_leaves_no_worker(small_corpus, tmp_path, how):
    """With data-loader workers (data.num_workers=1): torchrun signals each rank's whole process group, so they get
    the signal too; they must ignore it (the rank saves, then stops them), and die with their rank after kill -9."""
    import os

    run = tmp_path / "run"
    p = subprocess.Popen([sys.executable, "-m", "megaloom", "train", "--nproc", "2",
                          *tiny_overrides(small_corpus, run, "train.steps=100000", "checkpoint.every=0",
                                          "data.num_workers=1")],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        wait_for_step(p, 2, 100000)
        assert len(_processes_of(run)) >= 6  # launcher, torchrun, two ranks and a data worker each
        if how.startswith("SIG"):  # SIGUSR1: torchrun must be told to handle it, or it dies and orphans the workers
            p.send_signal(getattr(signal, how))
        else:
            os.killpg(p.pid, signal.SIGKILL)  # the launcher's whole process group, as `kill -9 -PGID`
        out, err = p.communicate(timeout=120)
        alive = _gone_within(run, 10)
        assert not alive, (alive, err[-3000:])
    finally:
        for pid in _processes_of(run):
            os.kill(pid, signal.SIGKILL)
    if how.startswith("SIG"):  # passed on to every rank: they saved the same step and stopped; one line, exit 0
        assert p.returncode == 0, err[-3000:]
        assert "Traceback" not in err and "DataLoader worker" not in err, err[-3000:]
        (line,) = [x for x in err.splitlines() if x.startswith("megaloom:")]
        m = re.fullmatch(rf"megaloom: stopped by {how} at step (\d+); the last checkpoint is step (\d+) \(.*\)", line)
        assert m and m[1] == m[2], line
        reached = max(losses(run))  # the last step trained (train.log_every=1)
        assert int(m[1]) == reached
        latest = (run / "checkpoints" / "latest").read_text().strip()
        assert latest == f"step_{reached:08d}"
        files = {f.name for f in (run / "checkpoints" / latest).iterdir()}
        assert {"__0_0.distcp", "__1_0.distcp", "rng_rank0.pt", "rng_rank1.pt"} <= files, files  # both ranks


def test_nproc_launcher_exit_status_says_whether_every_rank_stopped_after_saving(tmp_path, capsys):
    """A stand-in for torchrun that, signalled, reports how its ranks ended (as torchrun_main does): the launcher
    exits 0 only when every rank stopped as asked, else 1 with one line naming the ranks and the last checkpoint."""
    import os
    import threading
    import time

    from megaloom.parallel.launch import run_torchrun

    (tmp_path / "checkpoints" / "step_00000010").mkdir(parents=True)
    (tmp_path / "checkpoints" / "latest").write_text("step_00000010")
    stand_in = ("import json, os, signal, sys, time\n"
                "def stop(*_):\n"
                "    open(os.environ['MEGALOOM_WORKER_EXITS'], 'w').write(sys.argv[1]); sys.exit(143)\n"
                "signal.signal(signal.SIGTERM, stop); open(sys.argv[2], 'w').close(); time.sleep(60)\n")

    def stopped(exits: str) -> int:
        ready = tmp_path / "ready"
        ready.unlink(missing_ok=True)

        def preempt() -> None:
            while not ready.exists():
                time.sleep(0.02)
            os.kill(os.getpid(), signal.SIGTERM)  # to the launcher (this process), which passes it on

        threading.Thread(target=preempt, daemon=True).start()
        return run_torchrun([sys.executable, "-c", stand_in, exits, str(ready)], run_dir=tmp_path)

    assert stopped('{"0": 0, "1": 0}') == 0
    assert capsys.readouterr().err == ""
    assert stopped('{"0": 1, "1": -9}') == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert line == ("megaloom: stopped: SIGTERM reached the job, but rank(s) 0 (exit status 1), 1 (killed by SIGKILL) "
                    "did not stop after saving (their output above says why); the last checkpoint is step 10 "
                    f"({tmp_path / 'checkpoints' / 'step_00000010'}): `megaloom train` resumes there")
