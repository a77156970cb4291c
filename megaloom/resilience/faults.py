"""Fault injection, so that every recovery path can be exercised on purpose (tests, drills).

MEGALOOM_FAULT holds ';'-separated faults, each `kind:key=value:...`:
    kill:rank=1:step=7             the rank SIGKILLs itself at the start of step 7
    hang:rank=1:step=5:seconds=60  the rank stops for 60 s before the step's collectives (as a hung device would)
    slow:rank=1:seconds=0.05       the rank's compute takes 50 ms longer every step (a straggler)
    nan:step=4:count=3             the data of steps 4..6 makes gradients NaN (all ranks; keyed to the data, so a
                                   rollback that skips that window does not meet it again)
    signal:rank=1:step=3:sig=15    the rank sends itself signal 15 (SIGTERM) at the start of step 3 (a preemption
                                   notice that reached one rank only)
Faults fire only in the first attempt of a torchrun job (TORCHELASTIC_RESTART_COUNT=0), so the restarted job
recovers, unless `always=1` is given.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field


@dataclass
class Fault:
    kind: str
    args: dict[str, float] = field(default_factory=dict)

    def applies(self, rank: int) -> bool:
        return "rank" not in self.args or int(self.args["rank"]) == rank


@dataclass
class FaultPlan:
    faults: list[Fault] = field(default_factory=list)
    rank: int = 0

    @classmethod
    def from_env(cls, rank: int) -> FaultPlan:
        spec = os.environ.get("MEGALOOM_FAULT", "").strip()
        if not spec:
            return cls(rank=rank)
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        faults = []
        for item in spec.split(";"):
            kind, *kvs = item.strip().split(":")
            if kind not in ("kill", "hang", "slow", "nan", "signal"):
                raise ValueError(f"MEGALOOM_FAULT: unknown fault kind '{kind}' (kill, hang, slow, nan, signal)")
            args = {k: float(v) for k, v in (kv.split("=", 1) for kv in kvs)}
            if first_attempt or args.get("always"):
                faults.append(Fault(kind, args))
        return cls(faults=[f for f in faults if f.applies(rank)], rank=rank)

    def _at(self, kind: str, step: int) -> Fault | None:
        for f in self.faults:
            if f.kind == kind and ("step" not in f.args or int(f.args["step"]) <= step
                                   < int(f.args["step"]) + int(f.args.get("count", 1))):
                return f
        return None

    def before_step(self, step: int, recorder=None) -> None:
        """Called at the start of (1-based) step `step`."""
        if self._at("kill", step):
            os.kill(os.getpid(), signal.SIGKILL)
        sig = self._at("signal", step)
        if sig:
            os.kill(os.getpid(), int(sig.args.get("sig", signal.SIGTERM)))
        hang = self._at("hang", step)
        if hang:  # like a hung device: this rank simply never reaches its next collective
            time.sleep(hang.args.get("seconds", 3600))
        slow = self._at("slow", step)
        if slow:
            time.sleep(slow.args.get("seconds", 0.05))

    def nan_now(self, step: int) -> bool:
        return self._at("nan", step) is not None

    def slow_seconds(self) -> float:
        f = next((f for f in self.faults if f.kind == "slow"), None)
        return f.args.get("seconds", 0.05) if f else 0.0
