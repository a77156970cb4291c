"""A rank that died, as its surviving peers see it: one line naming it, not a raw backend traceback.

When a rank dies (killed, out of memory, a crash) the others fail in their next collective with the backend's
error ("[.../gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:46278: Connection reset by peer ... GLHF!",
NCCL's "remote process exited"), which named neither the rank that died nor what happens next, before every
restart. `peer_loss` recognises such an error; `PeerLost.describe` names the dead rank(s) from the heartbeat
files (run.dir/heartbeat/rank<N>.json hold each rank's node and pid: a rank of this node whose process is gone,
or a zombie not yet reaped by torchrun, died) and says whether torchrun restarts the job. Only the lowest rank
still alive says it, so the job's log holds one line, whatever its size; ranks of other nodes are not checked
(their processes cannot be seen from here), so a death there reads as "a rank of another node".
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from megaloom.errors import PeerLost as PeerLost
from megaloom.observe.heartbeat import node_name
from megaloom.parallel.last_words import last_checkpoint, restarts, say, to_launcher

# What a collective on a dead peer raises (gloo's TCP transport, NCCL, the TCPStore), matched in the message.
PEER_LOSS = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Connection refused",
             "remote process exited", "ncclRemoteError", "NCCL communicator was aborted")


def peer_loss(e: BaseException) -> str | None:
    """The pattern of PEER_LOSS in ``e`` (or the exceptions it was raised from), None when it is no peer loss."""
    seen = 0
    while e is not None and seen < 8:
        if isinstance(e, RuntimeError):
            text = str(e)
            for pattern in PEER_LOSS:
                if pattern in text:
                    return pattern
        e, seen = e.__cause__ or e.__context__, seen + 1
    return None


def _gone(pid: int) -> bool:
    """The process has ended (or is a zombie its parent has not reaped yet)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True
    except (OSError, IndexError):  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except OSError:
            return False
        return False


def dead_ranks(run_dir: str | Path, world: int) -> tuple[list[int], bool]:
    """(ranks of this node whose process is gone, whether some ranks could not be checked: another node's, or
    one without a heartbeat file)."""
    here, dead, unchecked = node_name(), [], False
    for rank in range(world):
        try:
            beat = json.loads((Path(run_dir) / "heartbeat" / f"rank{rank}.json").read_text())
        except (OSError, ValueError):
            unchecked = True
            continue
        if beat.get("node") != here or not isinstance(beat.get("pid"), int):
            unchecked = True
        elif _gone(beat["pid"]):
            dead.append(rank)
    return dead, unchecked


def restart_note(run_dir: str | Path | None = None) -> str:
    """What happens next: torchrun's restart (its environment says how many are left), or a resume by hand from
    the checkpoint in ``run_dir`` it names."""
    r = restarts()
    if r is not None and r[0] < r[1]:
        return (f"torchrun restarts the job (restart {r[0] + 1} of {r[1]}), which resumes from the newest "
                "checkpoint")
    if r is not None:
        return f"no restart left (--max-restarts {r[1]}); {last_checkpoint(run_dir)}"
    return f"start the job again; {last_checkpoint(run_dir)}"


def describe(error_pattern: str, rank: int, world: int, step: int | None, run_dir: str | Path,
             settle_s: float = 2.0) -> str:
    """The one line for the job, or "" when a lower rank still alive will say it, or when this rank handed it to
    the launcher of `megaloom train --nproc N`, which says it (parallel/last_words.py). ``step``: the last step this
    rank finished (None: while the job was starting). A dying process closes its sockets before it is a zombie, so
    the connection may be lost a moment before the death shows: up to ``settle_s`` is given to it."""
    deadline = time.monotonic() + settle_s
    while True:
        dead, unchecked = dead_ranks(run_dir, world)
        if dead or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    alive = [r for r in range(world) if r not in dead]
    if alive and rank != min(alive):
        return ""
    if dead:
        who = f"rank {dead[0]} died" if len(dead) == 1 else f"ranks {', '.join(map(str, dead))} died"
    elif unchecked:
        who = "a rank of another node (or without a heartbeat file) died or lost its network"
    else:
        who = "another rank left the job"
    when = "while the job was starting" if step is None else f"at step {step + 1}"
    line = f"{who} {when} (rank {rank} lost its connection to it: {error_pattern}); {restart_note(run_dir)}"
    if to_launcher() is not None:  # `megaloom train --nproc N` says the job's one line (parallel/last_words.py)
        say(f"stopped: {line}", kind="peer_lost", dead=dead, step=None if step is None else step + 1,
            seen_by=rank, pattern=error_pattern)
        return ""
    return line
