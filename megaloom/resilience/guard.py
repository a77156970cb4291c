"""The training loop's single handle on resilience: faults, heartbeat, hang watchdog, stragglers, bad steps."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from megaloom.config import Config
from megaloom.observe.heartbeat import Heartbeat, node_name
from megaloom.parallel.comm import LastOpRecorder
from megaloom.parallel.host_group import HostGroup
from megaloom.resilience.faults import FaultPlan
from megaloom.resilience.straggler import StragglerDetector
from megaloom.resilience.watchdog import Watchdog


class Resilience:
    def __init__(self, cfg: Config, run_dir: Path, rank: int, world_size: int, mesh):
        r = cfg.resilience
        self.cfg, self.rank = r, rank
        mesh.recorder = LastOpRecorder()  # every collective now says what it is while in flight
        self.recorder = mesh.recorder
        self.faults = FaultPlan.from_env(rank)
        self.heartbeat = Heartbeat(run_dir, rank, r.heartbeat_every_s, self.recorder).start() if r.heartbeat else None
        self.watchdog = (Watchdog(run_dir, rank, r.hang_timeout_s, self.recorder, self.heartbeat,
                                  world_size=world_size).start() if r.hang_timeout_s > 0 else None)
        # The loop's host-side control group (gloo, whatever trains): the straggler check's times and the stop
        # signals' agreement. Collective, every rank makes it here. Not the checkpoint group, which the
        # background writer thread uses at the same time.
        wanted = r.straggler_every > 0 or r.save_on_signal
        self.control = control = HostGroup(r.collective_timeout_s) if world_size > 1 and wanted else None
        # compute time from CUDA events on a GPU (NCCL returns at enqueue), from the host's clock on CPU
        self.straggler = StragglerDetector.for_device(mesh.device, world_size, r.straggler_factor, self.recorder,
                                                      control)
        # Every rank's node, on rank 0 (once; O(world) names): a straggler is reported with its node, for the
        # bad-node eviction of the next restart (suspects.py).
        self.nodes = control.gather(node_name()) if control is not None else [node_name()]
        self.bad_in_a_row = 0
        self._poison = None

    def before_step(self, step: int, model: torch.nn.Module, data_step: int | None = None) -> None:
        """`step` is the 1-based step about to run; `data_step` the step whose data it reads (they differ after
        a rollback skipped a data window)."""
        self.faults.before_step(step, self.recorder)
        if self.faults.nan_now(data_step or step):  # injected bad data: one weight's gradients become NaN
            p = next(model.parameters())
            self._poison = p.register_hook(lambda g: torch.full_like(g, float("nan")))
        self.straggler.start_step()

    def after_step(self, step: int, skipped: bool, wall_s: float) -> bool:
        """Returns True when the run must roll back (resilience.max_bad_steps non-finite steps in a row)."""
        if self._poison is not None:
            self._poison.remove()
            self._poison = None
        self.straggler.end_step(wall_s)
        if self.watchdog is not None:
            self.watchdog.progress(step)
        if self.heartbeat is not None:
            self.heartbeat.update(step)  # memory only: the heartbeat thread writes
        self.bad_in_a_row = self.bad_in_a_row + 1 if skipped else 0
        return self.bad_in_a_row >= self.cfg.max_bad_steps

    def stragglers_due(self, step: int) -> bool:
        return self.cfg.straggler_every > 0 and step % self.cfg.straggler_every == 0

    def paused(self):
        return self.watchdog.paused() if self.watchdog is not None else contextlib.nullcontext()

    def close(self) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()
        if self.heartbeat is not None:
            self.heartbeat.stop()
