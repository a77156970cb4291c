"""Hang detection: a side thread per rank that notices when training stops making progress.

Progress is a finished optimizer step. The watchdog arms after the first step (so compilation and the first
step's warm-up never count) and is paused around known long phases (checkpoint saves, evaluation). When a rank
fires it writes run.dir/watchdog/rank<N>-<time>.txt at once (its last collective as the host saw it, what the
flight recorder says has not finished, the Python stacks of all threads), then waits one heartbeat interval so
that every live rank's heartbeat thread has written its collective count since, and (on the reporting ranks:
the first and the last, so that the fault's report does not cost the shared file system world x world reads)
adds the table of which ranks are stuck in which collective and which never arrived there (their count is
behind). Then it exits the process non-zero, and torchrun (--max-restarts) restarts the job from the latest
checkpoint. NCCL collectives return once enqueued, so on GPUs the stall shows as a step that never finishes:
step progress covers it, and the flight recorder (NCCL's own watchdog thread marks each collective completed on
the device) names the collective. The process-group timeout (`resilience.collective_timeout_s`) is validated to
be longer, so this report comes first.
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
from megaloom.resilience import flight_recorder, suspects

log = get_logger(__name__)


class Watchdog:
    def __init__(self, run_dir: Path, rank: int, timeout_s: float, recorder, heartbeat: Heartbeat | None,
                 exit_code: int = 3, world_size: int = 1):
        self.run_dir, self.rank, self.timeout_s = Path(run_dir), rank, timeout_s
        self.recorder, self.heartbeat, self.exit_code = recorder, heartbeat, exit_code
        self.reports_table = rank in (0, world_size - 1)
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
        interval = max(0.2, min(1.0, self.timeout_s / 5))  # a clock check only: no I/O while healthy
        while not self._stop.wait(interval):
            idle = time.monotonic() - self.last_progress
            if self.armed and not self._paused and idle > self.timeout_s:
                self._fire(idle)

    def report(self, idle: float, dumps: list[tuple[Path, dict]] = (), beats: list[dict] | None = None,
               stacks: bool = True, most_rows: int | None = None) -> str:
        """The report; ``beats`` (the ranks' heartbeats) adds the cross-rank table, ``most_rows`` shortens it."""
        lines = [f"megaloom watchdog: rank {self.rank} made no progress for {idle:.1f}s "
                 f"(resilience.hang_timeout_s={self.timeout_s:g}) after step {self.step}.",
                 f"this rank's last collective: {self._describe()}"]
        for path, data in dumps:
            lines += flight_recorder.summary(path, data)
        lines.append("")
        if beats:
            lines += self._table(beats, most_rows)
        if not stacks:
            return "\n".join(lines).rstrip()
        lines += ["", "Python stacks of all threads:"]
        frames = sys._current_frames()
        for th in threading.enumerate():
            frame = frames.get(th.ident)
            if frame is not None:
                lines.append(f"--- thread {th.name}")
                lines.extend(s.rstrip() for s in traceback.format_stack(frame))
        return "\n".join(lines)

    @staticmethod
    def _table(beats: list[dict], most_rows: int | None = None) -> list[str]:
        now = time.time()
        top = max(b.get("op_count", 0) for b in beats)
        lines = ["rank  step  collectives     age  state"]
        shown = beats if most_rows is None or len(beats) <= most_rows else [
            b for b in beats if b.get("op_count", 0) < top][:most_rows]  # the log: the suspects only
        for b in shown:
            behind = b.get("op_count", 0) < top
            state = (f"never arrived (stopped in: {b.get('last_op')})" if behind
                     else f"waiting in: {b.get('last_op')}")
            lines.append(f"{b['rank']:>4}  {b['step']:>4}  {b.get('op_count', 0):>11}  {now - b['time']:>5.0f}s  "
                         f"{state}")
        if len(shown) < len(beats):
            lines.append(f"({len(beats) - len(shown)} more rows in the report file)")
        stuck = [b["rank"] for b in beats if b.get("op_count", 0) < top]
        if stuck:
            named = stuck if most_rows is None or len(stuck) <= most_rows else f"{stuck[:most_rows]} ... {len(stuck)}"
            lines.append(f"suspect rank(s): {named} (behind the others in the collective sequence)")
        return lines

    def _describe(self) -> str:
        describe = getattr(self.recorder, "describe", None)
        return describe() if describe else "(collectives not recorded)"

    def _fire(self, idle: float) -> None:
        out = self.run_dir / "watchdog"
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"rank{self.rank}-{int(time.time())}.txt"
        dumps = flight_recorder.dump(out, self.rank)
        if self.heartbeat is not None:
            self.heartbeat.write()
        path.write_text(self.report(idle, dumps))  # on disk now, should torchrun stop us during the wait
        beats = None
        if self.heartbeat is not None:
            # every live rank's heartbeat thread writes within one interval: their counts are then fresh
            time.sleep(self.heartbeat.every_s + 0.5)
            if self.reports_table:
                beats = read_heartbeats(self.run_dir)
                path.write_text(self.report(idle, dumps, beats))
                top = max((b.get("op_count", 0) for b in beats), default=0)
                stuck = {b["rank"]: b.get("node", "?") for b in beats if b.get("op_count", 0) < top}
                suspects.record(self.run_dir, "hang", self.step, stuck, f"behind in the collectives; {path.name}")
        log.error(self.report(idle, dumps, beats, stacks=False, most_rows=32) + f"\n(full report: {path})",
                  extra=TO_STDERR)
        os._exit(self.exit_code)  # the main thread is stuck; only a hard exit gets torchrun to restart us
