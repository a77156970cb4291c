"""Hang detection: a side thread per rank that notices when training stops making progress.

Progress is a finished optimizer step. The watchdog arms after the first step (so compilation and the first
step's warm-up never count) and is paused around known long phases (checkpoint saves, evaluation). While it
runs it also refreshes this rank's heartbeat file every second with the collective in flight, so that when a
rank fires, its report can say which ranks are stuck in which collective and which never arrived there
(their collective count is behind). Then it exits the process non-zero, and torchrun (--max-restarts) restarts
the job from the latest checkpoint. NCCL collectives return once enqueued, so on GPUs the stall shows as a
step that never finishes rather than a collective that never returns: step progress covers both.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import traceback
from pathlib import Path

from megaloom.observe.heartbeat import Heartbeat, read_heartbeats
from megaloom.observe.log import TO_STDERR, get_logger

log = get_logger(__name__)


class Watchdog:
    def __init__(self, run_dir: Path, rank: int, timeout_s: float, recorder, heartbeat: Heartbeat | None,
                 exit_code: int = 3):
        self.run_dir, self.rank, self.timeout_s = Path(run_dir), rank, timeout_s
        self.recorder, self.heartbeat, self.exit_code = recorder, heartbeat, exit_code
        self.step = 0
        self.last_progress = time.monotonic()
        self.armed = False
        self._paused = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="megaloom-watchdog", daemon=True)

    def start(self) -> Watchdog:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def progress(self, step: int) -> None:
        self.step, self.last_progress, self.armed = step, time.monotonic(), True

    @contextlib.contextmanager
    def paused(self):
        """A long but healthy phase (checkpoint save, evaluation): do not count it as a hang."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1
            self.last_progress = time.monotonic()

    def _run(self) -> None:
        interval = max(0.2, min(1.0, self.timeout_s / 5))
        while not self._stop.wait(interval):
            if self.heartbeat is not None:
                self.heartbeat.beat(self.step, self.recorder, force=True)
            idle = time.monotonic() - self.last_progress
            if self.armed and not self._paused and idle > self.timeout_s:
                self._fire(idle)

    def report(self, idle: float) -> str:
        lines = [f"megaloom watchdog: rank {self.rank} made no progress for {idle:.1f}s "
                 f"(resilience.hang_timeout_s={self.timeout_s:g}) after step {self.step}.",
                 f"this rank's last collective: {self._describe()}", ""]
        beats = read_heartbeats(self.run_dir)
        if beats:
            top = max(b.get("op_count", 0) for b in beats)
            lines.append("rank  step  collectives  state")
            for b in beats:
                behind = b.get("op_count", 0) < top
                state = (f"never arrived (stopped in: {b.get('last_op')})" if behind
                         else f"waiting in: {b.get('last_op')}")
                lines.append(f"{b['rank']:>4}  {b['step']:>4}  {b.get('op_count', 0):>11}  {state}")
            stuck = [b["rank"] for b in beats if b.get("op_count", 0) < top]
            if stuck:
                lines.append(f"suspect rank(s): {stuck} (behind the others in the collective sequence)")
        lines += ["", "Python stacks of all threads:"]
        frames = sys._current_frames()
        for th in threading.enumerate():
            frame = frames.get(th.ident)
            if frame is not None:
                lines.append(f"--- thread {th.name}")
                lines.extend(s.rstrip() for s in traceback.format_stack(frame))
        return "\n".join(lines)

    def _describe(self) -> str:
        describe = getattr(self.recorder, "describe", None)
        return describe() if describe else "(collectives not recorded)"

    def _fire(self, idle: float) -> None:
        text = self.report(idle)
        out = self.run_dir / "watchdog"
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"rank{self.rank}-{int(time.time())}.txt"
        path.write_text(text)
        log.error(text.split("\n\nPython stacks")[0] + f"\n(full report: {path})", extra=TO_STDERR)
        os._exit(self.exit_code)  # the main thread is stuck; only a hard exit gets torchrun to restart us
