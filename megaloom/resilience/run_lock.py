"""One run per run directory: rank 0 holds an exclusive lock on run.dir/.lock for the run's life.

Two runs on one run.dir interleave metrics.jsonl and remove or overwrite each other's checkpoints. The lock is
`fcntl.flock` on an open file: the kernel releases it when the holding process ends, however it ends (crash,
SIGKILL), so a restarted job (torchrun --max-restarts, or by hand) takes it again at once, and there is never a
stale lock to remove by hand. Only rank 0 takes it: the other ranks of the same job never compete for it. The
file names the holder (pid, host, start time) for the message the second run prints. Within one process the
lock is re-entrant (tests and notebooks build several trainers on one directory in turn). A start that fails
(a config refused, a checkpoint of another shape) removes a lock file it created (`RunLock.release(discard=True)`):
no `.lock` is left in a directory where no run ran. Removal unlinks while the lock is held, and a taker checks that
the file it locked is still the one at run.dir/.lock (else it takes the new one), so two runs never both hold it.
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


def _try_lock(run_dir: Path) -> tuple[IO[str] | None, bool]:
    """(the open, locked file, whether this call created it); the file is None where the file system has no locks
    (warned); RunDirLocked when held."""
    while True:
        created = not (run_dir / LOCK_NAME).exists()
        f = _lock_once(run_dir)
        if f is None or _still_linked(f, run_dir / LOCK_NAME):
            return f, created
        f.close()  # locked a file its holder removed as it let go (a failed start's): take the one there now


def _still_linked(f: IO[str], path: Path) -> bool:
    try:
        return os.fstat(f.fileno()).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        return False


def _lock_once(run_dir: Path) -> IO[str] | None:
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
    f, created = _try_lock(run_dir)
    if f is not None:
        try:  # who holds it, for the refusal of a second run (best effort: the lock is what counts)
            f.seek(0)
            f.truncate()
            f.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}))
            f.flush()
        except OSError:
            pass
    _HELD[key] = [f, 1, created, run_dir / LOCK_NAME]
    return RunLock(key)


def check_run_dir_free(run_dir: Path) -> None:
    """Raise RunDirLocked if another process holds ``run_dir``'s lock now, RunDirUnwritable if it cannot be
    written (a launcher's early check, creating the directory: the workers' rank 0 takes the real lock)."""
    if str(run_dir.resolve()) not in _HELD:
        f, created = _try_lock(run_dir)
        if f is not None:
            if created:  # the run's rank 0 takes (and creates) its own; none is left if the job never starts
                _unlink(run_dir / LOCK_NAME)
            f.close()  # closing releases the lock


class RunLock:
    def __init__(self, key: str) -> None:
        self._key: str | None = key

    def release(self, discard: bool = False) -> None:
        """Idempotent; the lock goes when the last holder in this process releases it (or the process ends).
        ``discard``: a start that failed; the lock file goes too if this process created it."""
        if self._key is None or self._key not in _HELD:
            return
        entry = _HELD[self._key]
        entry[1] -= 1
        entry[2] = entry[2] and discard  # a holder that ran keeps the file: it marks the directory as a run's
        if entry[1] == 0:
            del _HELD[self._key]
            if entry[0] is not None:
                if entry[2]:
                    _unlink(entry[3])  # while still locked: a taker that opened it sees it gone and retries
                entry[0].close()
        self._key = None


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass
