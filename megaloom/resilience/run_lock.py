"""One run per run directory: rank 0 holds an exclusive lock on run.dir/.lock for the run's life.

Two runs on one run.dir interleave metrics.jsonl and remove or overwrite each other's checkpoints. The lock is
`fcntl.flock` on an open file: the kernel releases it when the holding process ends, however it ends (crash,
SIGKILL), so a restarted job (torchrun --max-restarts, or by hand) takes it again at once, and there is never a
stale lock to remove by hand. Only rank 0 takes it: the other ranks of the same job never compete for it. The
file names the holder (pid, host, start time) for the message the second run prints. Within one process the
lock is re-entrant (tests and notebooks build several trainers on one directory in turn).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import IO

from megaloom.errors import RunDirLocked, RunDirUnwritable
from megaloom.observe.log import get_logger

log = get_logger(__name__)
LOCK_NAME = ".lock"
_HELD: dict[str, list] = {}  # resolved run dir -> [open lock file, holders in this process]


def _open_lock_file(run_dir: Path) -> IO[str]:
    """run.dir (created if missing) and its lock file, open for the run's life. A directory this process cannot
    write is one line naming it and the fix, here, before the run does any work (a full disk is left to the
    caller's no-space line)."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        if not os.access(run_dir, os.W_OK | os.X_OK):  # a lock file left writable in a read-only directory
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(run_dir))
        return open(run_dir / LOCK_NAME, "a+")  # noqa: SIM115 (held open for the run's life)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise
        where = f" ({e.filename})" if e.filename and str(e.filename) != str(run_dir) else ""
        raise RunDirUnwritable(f"run.dir {run_dir} cannot be written: {e.strerror or e}{where}; a run writes its "
                               "config, metrics and checkpoints there: make it writable, or set run.dir to a "
                               "directory you can write.") from e


def _holder(f: IO[str]) -> str:
    try:
        f.seek(0)
        info = json.loads(f.read() or "{}")
    except (OSError, ValueError):
        info = {}
    if not info:
        return "another process"
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.get("started", 0)))
    return f"pid {info.get('pid')} on host {info.get('host')}, started {when}"


def _try_lock(run_dir: Path) -> IO[str] | None:
    """The open, locked file; None where the file system has no locks (warned); RunDirLocked when held."""
    f = _open_lock_file(run_dir)
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            who = _holder(f)
            f.close()
            raise RunDirLocked(f"run.dir {run_dir} is in use by another megaloom run ({who}): two runs in one "
                               "directory would interleave metrics and overwrite each other's checkpoints; wait "
                               "for it to end or stop it, or set another run.dir.") from e
        f.close()
        log.warning(f"WARNING: cannot lock {run_dir / LOCK_NAME} ({e.strerror}: a file system without locks); a "
                    "second run on this run.dir would not be refused.")
        return None
    return f


def lock_run_dir(run_dir: Path) -> RunLock:
    """Take (or, in this process, share) the lock of ``run_dir``, creating the directory; raise RunDirLocked
    when another live process holds it, RunDirUnwritable when it cannot be written."""
    key = str(run_dir.resolve())
    if key in _HELD:
        _HELD[key][1] += 1
        return RunLock(key)
    f = _try_lock(run_dir)
    if f is not None:
        try:  # who holds it, for the refusal of a second run (best effort: the lock is what counts)
            f.seek(0)
            f.truncate()
            f.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}))
            f.flush()
        except OSError:
            pass
    _HELD[key] = [f, 1]
    return RunLock(key)


def check_run_dir_free(run_dir: Path) -> None:
    """Raise RunDirLocked if another process holds ``run_dir``'s lock now, RunDirUnwritable if it cannot be
    written (a launcher's early check, creating the directory: the workers' rank 0 takes the real lock)."""
    if str(run_dir.resolve()) not in _HELD:
        f = _try_lock(run_dir)
        if f is not None:
            f.close()  # closing releases the lock


class RunLock:
    def __init__(self, key: str) -> None:
        self._key: str | None = key

    def release(self) -> None:
        """Idempotent; the lock goes when the last holder in this process releases it (or the process ends)."""
        if self._key is None or self._key not in _HELD:
            return
        entry = _HELD[self._key]
        entry[1] -= 1
        if entry[1] == 0:
            del _HELD[self._key]
            if entry[0] is not None:
                entry[0].close()
        self._key = None
