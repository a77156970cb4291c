"""The line a surviving rank prints when another rank died (resilience/peers.py): it names the dead rank from the
heartbeat files, and only the lowest rank still alive says it."""

import json
import os
import subprocess
import sys

from megaloom.observe.heartbeat import node_name
from megaloom.resilience.peers import describe, peer_loss


def _beats(run_dir, pids: dict[int, int], node: str | None = None) -> None:
    (run_dir / "heartbeat").mkdir(parents=True, exist_ok=True)
    for rank, pid in pids.items():
        beat = {"rank": rank, "node": node or node_name(), "pid": pid, "step": 7}
        (run_dir / "heartbeat" / f"rank{rank}.json").write_text(json.dumps(beat))


def test_the_lowest_live_rank_names_the_dead_one(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "2")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    alive = os.getpid()
    err = RuntimeError("[pair.cc:537] Read error [127.0.0.1]:46278: Connection reset by peer. GLHF!")
    try:  # the backend's error as the cause of another
        raise ValueError("while reducing gradients") from err
    except ValueError as wrapped:
        pattern = peer_loss(wrapped)
    assert pattern == "Connection reset by peer" and peer_loss(RuntimeError("CUDA out of memory")) is None

    _beats(tmp_path, {0: alive, 1: int(gone), 2: alive, 3: alive})
    assert describe(pattern, 0, 4, 7, tmp_path) == (
        "rank 1 died at step 8 (rank 0 lost its connection to it: Connection reset by peer); torchrun restarts the "
        "job (restart 2 of 2), which resumes from the newest checkpoint")
    assert describe(pattern, 2, 4, 7, tmp_path) == ""  # rank 0 lives and says it: one line for the job

    _beats(tmp_path, {0: int(gone), 1: alive})  # rank 0 died: rank 1 speaks
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    assert describe(pattern, 1, 2, None, tmp_path).startswith(
        "rank 0 died while the job was starting (rank 1 lost its connection to it: Connection reset by peer); no "
        "restart left (--max-restarts 2)")

    _beats(tmp_path, {0: alive, 1: alive}, node="elsewhere")  # processes of another node cannot be checked
    assert describe(pattern, 0, 2, 3, tmp_path, settle_s=0).startswith(
        "a rank of another node (or without a heartbeat file) died")
