"""A rank's death under `megaloom train --nproc 2` (kill -9 of a rank, a killed data-loader worker) ends in exactly one
line naming the rank, the cause and the checkpoint the next run resumes from, and no traceback (parallel/launch.py,
parallel/last_words.py)."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megaloom.parallel.last_words import last_checkpoint
from megaloom.parallel.launch import _failure_line
from tests.conftest import tiny_overrides, wait_for_step

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

BASE = ["train.steps=100000", "train.micro_batch_size=2", "checkpoint.every=2"]


def _pid_of(run: Path, rank: int) -> int:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            return json.loads((run / "heartbeat" / f"rank{rank}.json").read_text())["pid"]
        except (OSError, ValueError, KeyError):
            time.sleep(0.1)
    raise AssertionError(f"no heartbeat of rank {rank}")


def _children(pid: int) -> list[int]:
    return [int(c) for t in Path(f"/proc/{pid}/task").iterdir() for c in (t / "children").read_text().split()]


def _run_and_kill(corpus, run: Path, victim, *extra: str) -> tuple[subprocess.Popen, str]:
    """`megaloom train --nproc 2` until step 5, then ``victim(run)`` (a pid) SIGKILLed: (process, stderr)."""
    p = subprocess.Popen([sys.executable, "-m", "megaloom", "train", "--nproc", "2",
                          *tiny_overrides(corpus, run, *BASE, *extra)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        wait_for_step(p, 5, 100000)
        os.kill(victim(run), signal.SIGKILL)
        _, err = p.communicate(timeout=90)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    return p, err


def _the_one_line(p: subprocess.Popen, err: str) -> str:
    assert p.returncode == 1, err[-3000:]
    assert "Traceback" not in err and "ChildFailedError" not in err, err[-3000:]
    assert "closing signal" not in err and "failed (exitcode" not in err, err[-3000:]  # torchrun's, replaced
    lines = [x for x in err.splitlines() if x.startswith("megaloom:")]
    assert len(lines) == 1, err[-3000:]
    assert err.rstrip("\n").splitlines()[-1] == lines[0]  # the last word
    return lines[0]


def test_kill_9_of_a_rank_ends_in_one_line_naming_it_and_the_checkpoint(small_corpus, tmp_path):
    run = tmp_path / "run"
    p, err = _run_and_kill(small_corpus, run, lambda r: _pid_of(r, 1))
    line = _the_one_line(p, err)
    m = re.fullmatch(r"megaloom: stopped: rank 1 died at step (\d+) \(killed by SIGKILL\); (.*)", line)
    assert m and int(m[1]) >= 5, line
    assert m[2] == last_checkpoint(run) and m[2].startswith("the last checkpoint is step "), line  # as on disk


def test_a_killed_data_loader_worker_ends_in_one_line_naming_it_and_the_checkpoint(small_corpus, tmp_path):
    run, killed = tmp_path / "run", []

    def loader_of_rank_0(r: Path) -> int:
        (child,) = _children(_pid_of(r, 0))  # data.num_workers=1: rank 0's one data-loader worker
        killed.append(child)
        return child

    p, err = _run_and_kill(small_corpus, run, loader_of_rank_0, "data.num_workers=1")
    line = _the_one_line(p, err)
    m = re.fullmatch(r"megaloom: stopped: a data-loader worker of rank 0 died at step (\d+) \((DataLoader worker "
                     r"\(pid(?:\(s\))? (\d+)\)[^)]*)\); (.*)", line)
    assert m and int(m[1]) >= 5 and int(m[3]) == killed[0], line
    assert m[4] == last_checkpoint(run) and m[4].startswith("the last checkpoint is step "), line


def test_the_line_puts_the_cause_first(tmp_path):
    """What the launcher says from how the ranks ended (torchrun's statuses) and what they handed over."""
    ckpt = last_checkpoint(tmp_path)
    assert ckpt == "no checkpoint was written: `megaloom train` starts again from step 0"
    seen = {0: {"kind": "peer_lost", "dead": [1], "step": 8, "line": "stopped: rank 1 died ..."}}
    assert _failure_line(1, {0: -15, 1: -9}, seen, tmp_path) == (
        f"rank 1 died at step 8 (killed by SIGKILL); {ckpt}", 1)
    # the rank that said why it stopped comes before the survivor that saw it go
    own = {0: {"kind": "error", "step": 3, "line": "error: data.paths: no such file"}, 1: seen[0]}
    assert _failure_line(1, {0: 2, 1: -15}, own, tmp_path) == (f"rank 0 stopped at step 3: data.paths: no such "
                                                               f"file; {ckpt}", 2)
    # nothing handed over (a rank died before it could say anything): torchrun's statuses, SIGTERM being its own
    assert _failure_line(1, {0: -15, 1: 1}, {}, tmp_path) == (
        f"rank 1 (exit status 1) ended the job (its output above says why); {ckpt}", 1)
    assert _failure_line(1, {}, {}, None)[0].startswith("torchrun failed (exit status 1; ")
