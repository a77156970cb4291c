"""The one line a job ends with when a rank dies, whoever says it.

Under `megaloom train --nproc N` the launcher (parallel/launch.py) says it, once, after torchrun has stopped: it knows
how every rank ended (torchrun's exit statuses), so it can name the rank that died and why (killed by SIGKILL, its
data-loader worker killed, an exit status). The ranks know what the launcher cannot see: which peer they lost and
at which step, or the error that stopped them. So a rank of a job that torchrun will not restart (its last attempt)
does not print its line but hands it to the launcher (`say`: a JSON file per rank in the launcher's directory,
MEGALOOM_LAUNCHER_DIR); a job that torchrun restarts prints it at once (the job goes on: the line says why it
restarted). Under a plain torchrun there is no launcher: each rank prints its own line (one rank for a lost peer,
resilience/peers.py), naming the checkpoint the next run resumes from.

Beside the launcher, which reads it; the ranks' resilience code (peers.py) and the command (cli.py) say through it.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

LAUNCHER_ENV = "MEGALOOM_LAUNCHER_DIR"  # set by parallel/launch.run_torchrun for its workers


def restarts() -> tuple[int, int] | None:
    """(restarts made, restarts allowed) of this torchrun job, None outside torchrun."""
    total = os.environ.get("TORCHELASTIC_MAX_RESTARTS")
    if total is None:
        return None
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0), int(total)


def restart_left() -> bool:
    r = restarts()
    return r is not None and r[0] < r[1]


def last_checkpoint(run_dir: str | Path | None) -> str:
    """Where the next `megaloom train` resumes from (the newest checkpoint `latest` names)."""
    if run_dir is None:
        return "the next run resumes from the newest checkpoint that verifies"
    root = Path(run_dir) / "checkpoints"
    try:
        name = (root / "latest").read_text().strip()
    except OSError:
        name = ""
    if name.startswith("step_") and (root / name).is_dir():
        return f"the last checkpoint is step {int(name[len('step_'):])} ({root / name}): `megaloom train` resumes there"
    return "no checkpoint was written: `megaloom train` starts again from step 0"


def to_launcher() -> Path | None:
    """The launcher's directory when this rank's last line goes there (module doc), else None."""
    where = os.environ.get(LAUNCHER_ENV)
    if not where or "RANK" not in os.environ or restart_left():
        return None
    return Path(where)


def say(line: str, **facts) -> None:
    """``megaloom: LINE`` on stderr, or handed to the launcher with ``facts`` (kind=..., step=..., dead=[...])
    when it speaks for the job (module doc)."""
    where = to_launcher()
    if where is not None:
        rank = int(os.environ["RANK"])
        try:
            (where / f"rank{rank}.json").write_text(json.dumps({"line": line, **facts}))
            return
        except OSError:
            pass  # the launcher's directory is gone: say it here
    print(f"megaloom: {line}", file=sys.stderr, flush=True)


def read(where: str | Path) -> dict[int, dict]:
    """{rank: the facts it handed over} from the launcher's directory."""
    out = {}
    for f in Path(where).glob("rank*.json"):
        try:
            out[int(f.stem[len("rank"):])] = json.loads(f.read_text())
        except (OSError, ValueError):
            pass
    return out


_LOADER = re.compile(r"DataLoader worker \(pid[^)]*\)[^.\n]*")


def loader_death(e: BaseException) -> str | None:
    """torch's words for a data-loader worker of this rank that died (killed, out of memory), None otherwise
    (also looked for in the exceptions ``e`` was raised from)."""
    seen = 0
    while e is not None and seen < 8:
        m = _LOADER.search(str(e)) if isinstance(e, RuntimeError) else None
        if m:
            return m[0].strip()
        e, seen = e.__cause__ or e.__context__, seen + 1
    return None
