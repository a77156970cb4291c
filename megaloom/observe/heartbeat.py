"""Per-rank heartbeat files that a person or a scheduler can read while the job runs (`megaloom status`).

run.dir/heartbeat/rank<N>.json holds {rank, step, time, last_op}; replaced atomically every step, so a
reader never sees half a file. A rank whose heartbeat stops moving is stuck or dead; the last operation says
where (filled in when the collectives' recorder is a comm.LastOpRecorder).
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

from megaloom.observe.log import get_logger

log = get_logger(__name__)


class Heartbeat:
    def __init__(self, run_dir: Path, rank: int, min_interval_s: float = 1.0):
        self.dir = run_dir / "heartbeat"
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError:
            pass  # a full disk: every beat then warns once (below) and training goes on
        self.path = self.dir / f"rank{rank}.json"
        self.rank = rank
        self.min_interval_s = min_interval_s
        self._last = 0.0
        self._warned = False

    def beat(self, step: int, recorder=None, force: bool = False) -> None:
        now = time.time()
        if not force and now - self._last < self.min_interval_s:
            return  # at most one small write a second, however fast the steps are
        self._last = now
        last_op = recorder.describe() if recorder is not None and hasattr(recorder, "describe") else None
        # the training loop and the watchdog thread both write: a temp name per thread avoids a race
        tmp = self.path.with_suffix(f".tmp{os.getpid()}-{threading.get_ident()}")
        try:
            tmp.write_text(json.dumps({"rank": self.rank, "step": step, "time": now, "pid": os.getpid(),
                                       "last_op": last_op, "op_count": getattr(recorder, "count", 0)}))
            os.replace(tmp, self.path)
        except OSError as e:
            # A heartbeat is for onlookers: a full disk or a vanished folder must not stop the watchdog thread
            # (nor training). Said once; later beats retry silently and resume when the disk has room again.
            tmp.unlink(missing_ok=True)
            if not self._warned:
                self._warned = True
                log.warning(f"WARNING: rank {self.rank} cannot write its heartbeat {self.path} ({e}); training goes "
                            "on, `megaloom status` shows this rank's last heartbeat until writes succeed again.")


def read_heartbeats(run_dir: str | Path) -> list[dict]:
    d = Path(run_dir) / "heartbeat"
    out = []
    for f in sorted(d.glob("rank*.json"), key=lambda p: int(p.stem[4:])):
        try:
            out.append(json.loads(f.read_text()))
        except (OSError, json.JSONDecodeError):
            continue
    return out


def status_table(run_dir: str | Path, now: float | None = None) -> str:
    beats = read_heartbeats(run_dir)
    if not beats:
        return f"{run_dir}: no heartbeat files (is it a megaloom run directory, and has it started?)"
    now = now or time.time()
    lines = [f"{'rank':>4}  {'step':>8}  {'age':>8}  last op"]
    for b in beats:
        lines.append(f"{b['rank']:>4}  {b['step']:>8}  {now - b['time']:>7.1f}s  {b.get('last_op') or '-'}")
    return "\n".join(lines)
