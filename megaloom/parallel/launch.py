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
from megaloom.parallel.last_words import LAUNCHER_ENV, last_checkpoint
from megaloom.parallel.last_words import read as read_last_words


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


# The signals a rank turns into a save and a stop (resilience/signals.py's StopRequests) and its data-loader workers
# ignore (data/loader.py): a scheduler's preemption notice and Ctrl-C. Here, below both, with what the launcher passes.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
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

    Without a signal: 0 when every rank finished; when a rank died or failed, 1 (2 when it stopped for a user
    error) and one line naming the rank(s), the cause and the checkpoint the next run resumes from, in place of
    torchrun's traceback (`_failure_line`). After a signal: 0 (130 for SIGINT) when every rank stopped as asked (it
    saved the step reached and exited 0, or 130 for Ctrl-C; rank 0 said where); otherwise 1, with one line naming
    the ranks that did not and the newest checkpoint in ``run_dir``. torchrun runs in its own process group, so a
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
        env[LAUNCHER_ENV] = tmp  # the ranks of the last attempt hand their last line here (last_words.py)
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
        if not received and rc == 0:
            return 0
        exits = _read_exits(exits_file)
        if not received:
            line, status = _failure_line(rc, exits, read_last_words(tmp), run_dir)
            print(f"megaloom: stopped: {line}", file=sys.stderr, flush=True)
            return status
    name = signal.Signals(received[0]).name
    if exits and all(code in STOPPED_CLEANLY for code in exits.values()):
        return 130 if received[0] == signal.SIGINT else 0
    print(f"megaloom: stopped: {name} reached the job, but {_not_stopped(exits)}; {last_checkpoint(run_dir)}",
          file=sys.stderr, flush=True)
    return 1


def _read_exits(path: Path) -> dict[int, int | None]:
    """{rank: exit status (negative: killed by that signal; None: still running)} written by torchrun_main; empty
    when it wrote none (torchrun itself was killed, or the signal came before any rank started)."""
    try:
        return {int(k): v for k, v in json.loads(path.read_text()).items()}
    except (OSError, ValueError):
        return {}


def _how(code: int | None) -> str:
    if code is None:
        return "still running when torchrun gave up on it"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


def _not_stopped(exits: dict[int, int | None]) -> str:
    if not exits:
        return "torchrun ended without saying how the ranks ended (no rank may have saved)"
    bad = {r: c for r, c in sorted(exits.items()) if c not in STOPPED_CLEANLY}
    return ("rank(s) " + ", ".join(f"{r} ({_how(c)})" for r, c in bad.items())
            + " did not stop after saving (their output above says why)")


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _failure_line(rc: int, exits: dict[int, int | None], words: dict[int, dict],
                  run_dir: Path | None) -> tuple[str, int]:
    """(the job's one line after torchrun failed without a signal, the launcher's exit status) from how each rank
    ended (``exits``: torchrun's statuses, written by torchrun_main) and what the ranks handed over (``words``:
    parallel/last_words.py). The cause first: a rank that said why it stopped (its data-loader worker died, an
    error), else the rank(s) a survivor saw die, else the ranks killed by a signal torchrun does not send, else any
    that failed; then how they ended and the checkpoint the next run resumes from."""
    own = {r: w for r, w in words.items() if w.get("kind") != "peer_lost"}
    seen = [w for w in words.values() if w.get("kind") == "peer_lost" and w.get("dead")]
    failed = {r: c for r, c in exits.items() if c != 0}
    if own:
        first = min(own)
        w = own[first]
        same = sorted(r for r, x in own.items() if x.get("line") == w.get("line") or
                      (w.get("kind") == x.get("kind") == "loader" and w.get("step") == x.get("step")))
        when = "" if w.get("step") is None else f" at step {w['step']}"
        if w.get("kind") == "loader":
            what = f"a data-loader worker of {_ranks(same)} died{when} ({w.get('cause')})"
        else:
            text = str(w.get("line", ""))
            what = f"{_ranks(same)} stopped{when}: {text.split(': ', 1)[1] if ': ' in text else text}"
        return f"{what}; {last_checkpoint(run_dir)}", 2 if w.get("kind") == "error" else 1
    if seen:
        dead = sorted({r for w in seen for r in w["dead"]})
        step = seen[0].get("step")
        when = "while the job was starting" if step is None else f"at step {step}"
        how = ", ".join(_how(failed[r]) if len(dead) == 1 else f"rank {r} {_how(failed[r])}"
                        for r in dead if r in failed)
        return f"{_ranks(dead)} died {when}" + (f" ({how})" if how else "") + f"; {last_checkpoint(run_dir)}", 1
    terminated = (-signal.SIGTERM, -signal.SIGINT)  # how torchrun stops the ranks that were still running
    causes = sorted(r for r, c in failed.items() if c is not None and c not in terminated) or sorted(failed)
    if causes:
        how = ", ".join(f"rank {r} ({_how(failed[r])})" for r in causes)
        return f"{how} ended the job (its output above says why); {last_checkpoint(run_dir)}", 1
    return f"torchrun failed (exit status {rc}; its output above says why); {last_checkpoint(run_dir)}", 1


def _dying_with_parent(cmd: list[str]) -> list[str]:
    """``python -m torch.distributed.run ARGS`` as a process that first asks to die with its parent, then runs
    torchrun in itself (a preexec_fn would do the same in the forked child, where only async-signal-safe work is
    safe when threads exist)."""
    if cmd[1:3] != ["-m", "torch.distributed.run"]:
        return cmd
    return [cmd[0], "-c", "from megaloom.parallel.launch import torchrun_main; torchrun_main()", *cmd[3:]]


def torchrun_main() -> None:
    """torchrun (arguments in sys.argv[1:]) that dies with its parent and ends without a traceback: stopped by a
    signal it passed on to the workers, it writes how each one ended (for run_torchrun's exit status) and exits
    128 + signal (the workers have said what they saved); when a worker failed, it writes how each one ended and
    exits 1 (run_torchrun says the job's one line). torchrun's log lines that this line replaces (the closing
    SIGTERM to each worker, "failed (exitcode: -9) local_rank: 1 ...") are left out. MEGALOOM_TRACEBACK=1 keeps
    torchrun's own output, traceback included."""
    import runpy

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    die_with_parent()
    workers = _track_worker_processes()
    loud = bool(os.environ.get("MEGALOOM_TRACEBACK"))
    if not loud:
        _quiet_torchrun_logs()
    sys.argv[0] = "torchrun"
    try:
        runpy.run_module("torch.distributed.run", run_name="__main__", alter_sys=True)
    except SignalException as e:
        # torchrun has passed the signal on and waited for the workers (then SIGKILLed those still running)
        if os.environ.get(_EXITS_ENV):
            _write_exits(Path(os.environ[_EXITS_ENV]), workers)
        sys.exit(128 + int(e.sigval))
    except ChildFailedError as e:
        if loud or not os.environ.get(_EXITS_ENV):
            raise
        exits = {str(rank): f.exitcode for rank, f in e.failures.items()}
        try:
            Path(os.environ[_EXITS_ENV]).write_text(json.dumps(exits))
        except OSError:
            pass
        sys.exit(1)


# What torchrun logs about its workers' ends that the launcher's one line says instead (matched in the message).
_REPLACED_LOGS = ("Sending process %s closing signal", "failed (exitcode: %s)", "death signal, shutting down",
                  "local_rank %s FAILED with no error file")


def _quiet_torchrun_logs() -> None:
    import logging

    class Replaced(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            return not any(m in str(record.msg) for m in _REPLACED_LOGS)

    for name in ("torch.distributed.elastic.multiprocessing.api", "torch.distributed.elastic.agent.server.api",
                 "torch.distributed.elastic.multiprocessing.errors"):
        logging.getLogger(name).addFilter(Replaced())


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


def main(argv: list[str] | None = None) -> int:
    """``python -m megaloom.parallel.launch TORCHRUN_ARGS``: torchrun as `megaloom train --nproc N` runs it, for a
    job that torchrun itself must start (several nodes, other rendezvous): the same arguments, the same workers, but
    the exit statuses and the one line of run_torchrun. After SIGTERM/SIGUSR1 it exits 0 when every rank saved and
    stopped (a plain torchrun exits 1 with a SignalException traceback: docs/resilience.md); when a rank dies, one
    line instead of torchrun's ChildFailedError traceback."""
    args = sys.argv[1:] if argv is None else argv
    return run_torchrun([sys.executable, "-m", "torch.distributed.run", *args])


if __name__ == "__main__":
    raise SystemExit(main())
