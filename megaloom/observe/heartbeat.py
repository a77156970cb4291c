"""Per-rank heartbeat files that a person or a scheduler can read while the job runs (`megaloom status`).

run.dir/heartbeat/rank<N>.json holds {rank, node, step, time, pid, last_op, op_count, every_s}, replaced atomically
(write a temporary file, rename), so a reader never sees half a file. One background thread per rank is the only
regular writer: one small write every `resilience.heartbeat_every_s` (10 s by default), however fast the steps
are, so 1,024 ranks make ~100 create+rename per second on a shared file system, not thousands. The training loop
only updates the step in memory. The thread keeps beating while the main thread is stuck in a collective, so a
stuck rank's file still says where it is; a rank whose file stops moving is dead or frozen (`kill -STOP`), which
`megaloom status` marks STALE. The watchdog writes one extra beat when it fires (watchdog.py).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path

from megaloom.observe.log import get_logger

log = get_logger(__name__)

STALE_AFTER_BEATS = 3  # a file older than this many intervals belongs to a rank that stopped beating


def node_name() -> str:
    """This process's node, as the scheduler names it."""
    return os.environ.get("SLURMD_NODENAME") or os.environ.get("MEGALOOM_NODE") or socket.gethostname()


class Heartbeat:
    def __init__(self, run_dir: Path, rank: int, every_s: float = 10.0, recorder=None):
        self.dir = Path(run_dir) / "heartbeat"
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError:
            pass  # a full disk: the first beat warns (below) and training goes on
        self.path = self.dir / f"rank{rank}.json"
        self.rank, self.every_s, self.recorder = rank, every_s, recorder
        self.node = node_name()
        self.step = 0
        self.writes = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._failed = False
        self._thread = threading.Thread(target=self._run, name="megaloom-heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        self.write()  # a fresh run shows up in `megaloom status` at once, not after the first interval
        self._thread.start()
        return self

    def stop(self) -> None:
        """The last beat (the final step), then the thread ends."""
        self._stop.set()
        self.write()

    def update(self, step: int) -> None:
        """The training loop: memory only (the thread writes)."""
        self.step = step

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.write()

    def write(self) -> None:
        """One beat now. Never raises: a full disk must not end training through its heartbeat (warned once)."""
        rec = self.recorder
        last_op = rec.describe() if rec is not None and hasattr(rec, "describe") else None
        record = {"rank": self.rank, "node": self.node, "step": self.step, "time": time.time(), "pid": os.getpid(),
                  "last_op": last_op, "op_count": getattr(rec, "count", 0), "every_s": self.every_s}
        with self._lock:  # the thread and the watchdog's forced beat share one temporary name
            tmp = self.path.with_suffix(f".tmp{os.getpid()}")
            try:
                tmp.write_text(json.dumps(record))
                os.replace(tmp, self.path)
                self.writes += 1
            except OSError as e:
                # A heartbeat is for onlookers: a full disk or a vanished folder must stop neither this thread nor
                # training. Said once; later beats retry silently and resume when the disk has room again.
                tmp.unlink(missing_ok=True)
                if not self._failed:
                    log.warning(f"WARNING: rank {self.rank} cannot write its heartbeat {self.path} ({e}); training "
                                "goes on; `megaloom status` shows its last beat until writes succeed again.")
                self._failed = True


def read_heartbeats(run_dir: str | Path) -> list[dict]:
    """Every rank's last beat, in rank order (unreadable files skipped)."""
    d = Path(run_dir) / "heartbeat"
    if not d.is_dir():
        return []
    with os.scandir(d) as it:  # one directory listing, no per-file stat
        names = [e.name for e in it if e.name.startswith("rank") and e.name.endswith(".json")]
    out = []
    for name in sorted(names, key=lambda n: int(n[4:-5]) if n[4:-5].isdigit() else -1):
        try:
            out.append(json.loads((d / name).read_bytes()))
        except (OSError, ValueError):
            continue
    return out


def is_stale(beat: dict, now: float) -> bool:
    return now - beat["time"] > STALE_AFTER_BEATS * float(beat.get("every_s") or 1.0)


def status_table(run_dir: str | Path, now: float | None = None) -> str:
    beats = read_heartbeats(run_dir)
    if not beats:
        return f"{run_dir}: no heartbeat files (is it a megaloom run directory, and has it started?)"
    now = now or time.time()
    steps = [b["step"] for b in beats]
    stale = [b["rank"] for b in beats if is_stale(b, now)]
    lines = [f"{len(beats)} ranks, steps {min(steps)}..{max(steps)}; "
             + (f"STALE (no beat for {STALE_AFTER_BEATS} intervals): {_short(stale)}" if stale else "all beating"),
             f"{'rank':>4}  {'node':<16}  {'step':>8}  {'age':>8}  last op"]
    for b in beats:
        flag = "  STALE" if is_stale(b, now) else ""
        lines.append(f"{b['rank']:>4}  {str(b.get('node', '-'))[:16]:<16}  {b['step']:>8}  {now - b['time']:>7.1f}s  "
                     f"{b.get('last_op') or '-'}{flag}")
    return "\n".join(lines)


def _short(ranks: list[int], most: int = 32) -> str:
    return str(ranks) if len(ranks) <= most else f"{ranks[:most]} ... ({len(ranks)} ranks)"
