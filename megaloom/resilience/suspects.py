"""Bad-node eviction (MegaScale): which nodes the checks named, and which to leave out when the job restarts.

A restarted job that lands on the node that broke it breaks again. So every check that names a rank also names
its node, in `run.dir/resilience/suspects.jsonl` (one JSON row per rank named: time, restart attempt, step, rank,
node, reason):

    straggler  the straggler check found the rank slower than resilience.straggler_factor x the others (rank 0
               writes; it holds every rank's node name, gathered once at start over the host-side group)
    hang       the hang watchdog's table found the rank behind the others in the collective sequence (the
               reporting ranks write; the heartbeats carry each rank's node)
    doctor     `megaloom doctor --run-dir DIR` found the rank slow or failing

`megaloom evict RUN_DIR` prints the nodes to leave out, comma-separated (what `srun --exclude` takes): a node the
doctor failed once, or a node named as slow or stuck in two separate events (two straggler checks, two hangs,
or one of each). A launcher script reads it before each attempt and starts torchrun on the other nodes
(docs/resilience.md has the SLURM loop); the run resumes from its newest checkpoint with fewer data-parallel
ranks, and since the global batch is a setting, each step's batch is the same (more accumulation per rank), so
the loss continues as the uninterrupted run's. megaloom never picks hosts itself: the scheduler does, told
which to avoid.

The node is `SLURMD_NODENAME` (the name SLURM's --exclude takes), else `MEGALOOM_NODE`, else the host name.
"""

from __future__ import annotations

import json
import os
import time
from collections import defaultdict
from pathlib import Path

SUSPECTS = Path("resilience") / "suspects.jsonl"
REASONS = ("straggler", "hang", "doctor")


def attempt() -> int:
    """The torchrun restart count of this job (0: the first attempt)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def record(run_dir: str | Path, reason: str, step: int, named: dict[int, str], detail: str = "") -> None:
    """Append one row per named rank (``named``: rank -> node). One write of all rows (O_APPEND): rows of
    concurrent writers never interleave within a line. Never raises: a full disk must not end the report that
    names the culprit."""
    if reason not in REASONS:
        raise ValueError(f"suspects: unknown reason {reason!r} ({', '.join(REASONS)})")
    if not named:
        return
    now, att = time.time(), attempt()
    rows = "".join(json.dumps({"time": now, "attempt": att, "step": step, "rank": r, "node": n, "reason": reason,
                               "detail": detail}) + "\n" for r, n in sorted(named.items()))
    path = Path(run_dir) / SUSPECTS
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, rows.encode())
        finally:
            os.close(fd)
    except OSError:
        pass


def read(run_dir: str | Path) -> list[dict]:
    """The rows so far (a torn last line of a killed writer is skipped)."""
    path = Path(run_dir) / SUSPECTS
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows


def to_evict(rows: list[dict], times: int = 2) -> dict[str, list[str]]:
    """node -> the reasons it is evicted: a doctor failure once, or slow/stuck in ``times`` separate events. An
    event is (reason, attempt, step): the two reporting ranks of one hang, or one check naming two ranks of a
    node, count once."""
    events: dict[str, set[tuple]] = defaultdict(set)
    doctor: set[str] = set()
    for r in rows:
        if r.get("reason") == "doctor":
            doctor.add(r["node"])
        elif r.get("reason") in REASONS:
            events[r["node"]].add((r["reason"], r.get("attempt", 0), r.get("step", 0)))
    out: dict[str, list[str]] = {}
    for node in sorted(doctor | set(events)):
        why = ["failed the doctor"] if node in doctor else []
        if len(events[node]) >= times:
            kinds = sorted({e[0] for e in events[node]})
            why.append(f"named {len(events[node])} times ({', '.join(kinds)})")
        if why:
            out[node] = why
    return out


def evict_command(run_dir: str, times: int = 2) -> str:
    """What `megaloom evict` prints: the nodes, comma-separated (empty when none)."""
    return ",".join(to_evict(read(run_dir), times))
