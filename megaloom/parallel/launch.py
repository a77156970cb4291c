"""Starting several processes: the torchrun command behind `megaloom train --nproc N`, run with signals passed on
and no process outliving the launcher."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

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


def run_torchrun(cmd: list[str]) -> int:
    """Run torchrun, passing it SIGTERM/SIGINT/SIGUSR1/SIGHUP sent to this launcher, and return its exit code; a run
    stopped by such a signal returns 130 for SIGINT, else 0 (the workers saved and rank 0 said where). torchrun runs
    in its own process group, so a terminal's Ctrl-C reaches it once (through here), and it dies with this
    process (die_with_parent), taking its workers with it (each worker does the same: training/trainer startup)."""
    env = dict(os.environ)
    # torchrun's --signals-to-handle (PET_ environment form, which its launcher copies into the variable its
    # process context reads); the latter too for a torch whose torchrun reads it directly
    env.setdefault("PET_SIGNALS_TO_HANDLE", _TORCHRUN_HANDLES)
    env.setdefault("TORCHELASTIC_SIGNALS_TO_HANDLE", env["PET_SIGNALS_TO_HANDLE"])
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
    if received:  # torchrun exits non-zero after any signal; the stop was asked for
        return 130 if received[0] == signal.SIGINT else 0
    return rc


def _dying_with_parent(cmd: list[str]) -> list[str]:
    """``python -m torch.distributed.run ARGS`` as a process that first asks to die with its parent, then runs
    torchrun in itself (a preexec_fn would do the same in the forked child, where only async-signal-safe work is
    safe when threads exist)."""
    if cmd[1:3] != ["-m", "torch.distributed.run"]:
        return cmd
    return [cmd[0], "-c", "from megaloom.parallel.launch import torchrun_main; torchrun_main()", *cmd[3:]]


def torchrun_main() -> None:
    """torchrun (arguments in sys.argv[1:]) that dies with its parent and, stopped by a signal it passed on to
    the workers, exits 128 + signal without a traceback (the workers have said what they saved)."""
    import runpy

    from torch.distributed.elastic.multiprocessing.api import SignalException

    die_with_parent()
    sys.argv[0] = "torchrun"
    try:
        runpy.run_module("torch.distributed.run", run_name="__main__", alter_sys=True)
    except SignalException as e:
        sys.exit(128 + int(e.sigval))
