"""Starting several processes: the torchrun command behind `megaloom train --nproc N`, run with signals passed on
and no process outliving the launcher."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from megaloom.config import ConfigError


def _strip_nproc(argv: list[str]) -> list[str]:
    """Drop --nproc/--max-restarts so a worker never tries to launch workers of its own."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in ("--nproc", "--max-restarts"):
            skip = True
        elif not a.startswith(("--nproc=", "--max-restarts=")):
            out.append(a)
    return out


def torchrun_command(nproc: int, argv: list[str], max_restarts: int = 0) -> list[str]:
    """``python -m torch.distributed.run --standalone --nproc-per-node N [--max-restarts K] -m megaloom train
    ARGV``: one node, a free rendezvous port picked by torchrun, every worker running the same training."""
    if nproc < 1:
        raise ConfigError(f"--nproc must be >= 1, got {nproc}; use the number of GPUs (or CPU processes) of "
                          "this node, e.g. --nproc 8.")
    if max_restarts < 0:
        raise ConfigError(f"--max-restarts must be >= 0, got {max_restarts}.")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    if max_restarts:
        cmd += ["--max-restarts", str(max_restarts)]
    return cmd + ["-m", "megaloom", "train", *_strip_nproc(list(argv))]


# Signals the launcher passes on to torchrun, which passes them to every worker (torchrun's --signals-to-handle:
# its default list lacks SIGUSR1, whose default action would kill torchrun and orphan the workers).
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP)
_TORCHRUN_HANDLES = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Linux: the kernel sends this process ``sig`` when its parent dies (prctl PR_SET_PDEATHSIG), so a worker or
    torchrun whose launcher was killed hard (`kill -9`) does not train on alone. Elsewhere: nothing."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before the prctl took effect
        os.kill(os.getpid(), sig)


# Exit statuses a rank ends with when a stop signal stopped it as asked (cli._cmd_train): 0 after saving the step
# reached on SIGTERM/SIGUSR1 (or after training to the end), 130 after Ctrl-C.
STOPPED_CLEANLY = (0, 130)
_EXITS_ENV = "MEGALOOM_WORKER_EXITS"  # file where torchrun_main writes how each rank ended after a signal


def run_torchrun(cmd: list[str], run_dir: Path | None = None) -> int:
    """Run torchrun, passing it SIGTERM/SIGINT/SIGUSR1/SIGHUP sent to this launcher, and return the exit status.

    Without a signal: torchrun's. After a signal: 0 (130 for SIGINT) when every rank stopped as asked (it saved
    the step reached and exited 0, or 130 for Ctrl-C; rank 0 said where); otherwise 1, with one line naming the
    ranks that did not and the newest checkpoint in ``run_dir``. torchrun runs in its own process group, so a
    terminal's Ctrl-C reaches it once (through here), and it dies with this process (die_with_parent), taking
    its workers with it (each worker does the same: training/trainer startup)."""
    env = dict(os.environ)
    # torchrun's --signals-to-handle (PET_ environment form, which its launcher copies into the variable its
    # process context reads); the latter too for a torch whose torchrun reads it directly
    env.setdefault("PET_SIGNALS_TO_HANDLE", _TORCHRUN_HANDLES)
    env.setdefault("TORCHELASTIC_SIGNALS_TO_HANDLE", env["PET_SIGNALS_TO_HANDLE"])
    with tempfile.TemporaryDirectory(prefix="megaloom-launch-") as tmp:
        exits_file = Path(tmp) / "exits.json"
        env[_EXITS_ENV] = str(exits_file)
        proc = subprocess.Popen(_dying_with_parent(cmd), env=env, process_group=0)
        received: list[int] = []

        def forward(signum, frame) -> None:
            received.append(signum)
            if proc.poll() is None:
                proc.send_signal(signum)

        previous = {s: signal.signal(s, forward) for s in FORWARDED}
        try:
            rc = proc.wait()
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
        if not received:
            return rc
        exits = _read_exits(exits_file)
    name = signal.Signals(received[0]).name
    if exits and all(code in STOPPED_CLEANLY for code in exits.values()):
        return 130 if received[0] == signal.SIGINT else 0
    print(f"megaloom: stopped: {name} reached the job, but {_not_stopped(exits)}; {_last_checkpoint(run_dir)}",
          file=sys.stderr, flush=True)
    return 1


def _read_exits(path: Path) -> dict[int, int | None]:
    """{rank: exit status (negative: killed by that signal; None: still running)} written by torchrun_main; empty
    when it wrote none (torchrun itself was killed, or the signal came before any rank started)."""
    try:
        return {int(k): v for k, v in json.loads(path.read_text()).items()}
    except (OSError, ValueError):
        return {}


def _not_stopped(exits: dict[int, int | None]) -> str:
    if not exits:
        return "torchrun ended without saying how the ranks ended (no rank may have saved)"

    def how(code: int | None) -> str:
        if code is None:
            return "still running when torchrun gave up on it"
        if code < 0:
            try:
                return f"killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"killed by signal {-code}"
        return f"exit status {code}"

    bad = {r: c for r, c in sorted(exits.items()) if c not in STOPPED_CLEANLY}
    return ("rank(s) " + ", ".join(f"{r} ({how(c)})" for r, c in bad.items())
            + " did not stop after saving (their output above says why)")


def _last_checkpoint(run_dir: Path | None) -> str:
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


def _dying_with_parent(cmd: list[str]) -> list[str]:
    """``python -m torch.distributed.run ARGS`` as a process that first asks to die with its parent, then runs
    torchrun in itself (a preexec_fn would do the same in the forked child, where only async-signal-safe work is
    safe when threads exist)."""
    if cmd[1:3] != ["-m", "torch.distributed.run"]:
        return cmd
    return [cmd[0], "-c", "from megaloom.parallel.launch import torchrun_main; torchrun_main()", *cmd[3:]]


def torchrun_main() -> None:
    """torchrun (arguments in sys.argv[1:]) that dies with its parent and, stopped by a signal it passed on to
    the workers, writes how each one ended (for run_torchrun's exit status) and exits 128 + signal without a
    traceback (the workers have said what they saved)."""
    import runpy

    from torch.distributed.elastic.multiprocessing.api import SignalException

    die_with_parent()
    workers = _track_worker_processes()
    sys.argv[0] = "torchrun"
    try:
        runpy.run_module("torch.distributed.run", run_name="__main__", alter_sys=True)
    except SignalException as e:
        # torchrun has passed the signal on and waited for the workers (then SIGKILLed those still running)
        if os.environ.get(_EXITS_ENV):
            _write_exits(Path(os.environ[_EXITS_ENV]), workers)
        sys.exit(128 + int(e.sigval))


def _track_worker_processes() -> list:
    """A list that will hold torchrun's newest set of worker processes (its SubprocessContext: one per attempt),
    from which their exit statuses are read once torchrun has stopped them."""
    from torch.distributed.elastic.multiprocessing import api

    newest: list = []
    init = api.SubprocessContext.__init__

    def tracked_init(self, *args, **kwargs) -> None:
        init(self, *args, **kwargs)
        newest[:] = [self]

    api.SubprocessContext.__init__ = tracked_init
    return newest


def _write_exits(path: Path, workers: list) -> None:
    handlers = getattr(workers[0], "subprocess_handlers", {}) if workers else {}
    try:
        path.write_text(json.dumps({str(rank): h.proc.poll() for rank, h in handlers.items()}))
    except OSError:
        pass  # the launcher then reports that it could not learn how the ranks ended
