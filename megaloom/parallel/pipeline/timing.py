"""What ran when on each pipeline rank: the planned timeline of a schedule (`checker.simulate`) and the measured
one (the executor's timers) share this form, which `megaloom.observe.timeline` renders."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

COMPUTE_KINDS = ("F", "B", "BI", "BW")
# Unit time per forward and backward; the zero-bubble halves of a backward take half each; messages are free.
DEFAULT_COSTS: Mapping[str, float] = {"F": 1.0, "B": 1.0, "BI": 0.5, "BW": 0.5, "COMM": 0.0}


@dataclass(frozen=True)
class TimedAction:
    rank: int
    kind: str  # F, B, BI, BW, or COMM for a batch of messages
    microbatch: int  # -1 for a message batch
    stage: int  # -1 for a message batch
    start: float
    end: float
    label: str = ""


@dataclass
class Timeline:
    """Per-rank actions; ``unit`` is "step" (planned, unit cost per F/B) or "s" (measured)."""

    name: str
    pp: int
    vpp: int
    microbatches: int
    ranks: list[list[TimedAction]]
    unit: str = "step"
    # Planned timelines only: the most (micro-batch, stage) activations each rank holds at once, counted from
    # a forward until its input-gradient backward (B or BI) frees them, and until the weight gradient (B or BW).
    peak_activations: list[int] = field(default_factory=list)
    peak_unfinished: list[int] = field(default_factory=list)

    @property
    def start(self) -> float:
        return min((a.start for rank in self.ranks for a in rank), default=0.0)

    @property
    def makespan(self) -> float:
        return max((a.end for rank in self.ranks for a in rank), default=0.0) - self.start

    def busy(self, rank: int) -> float:
        return sum(a.end - a.start for a in self.ranks[rank] if a.kind in COMPUTE_KINDS)

    @property
    def bubble_fraction(self) -> float:
        """Idle share of the ranks' time: 1 - busy / (pp * makespan)."""
        total = self.makespan * len(self.ranks)
        return 1.0 - sum(self.busy(r) for r in range(len(self.ranks))) / total if total > 0 else 0.0

    @property
    def bubble_ratio(self) -> float:
        """Idle time over compute time: the quantity of Megatron's (p - 1) / (v m)."""
        busy = sum(self.busy(r) for r in range(len(self.ranks)))
        return self.makespan * len(self.ranks) / busy - 1.0 if busy > 0 else 0.0
