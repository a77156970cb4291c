"""Pipeline schedules as data: for each pipeline rank, the ordered list of what it does.

An `Action` is a computation (F forward, B backward, or the zero-bubble split of B into BI, the gradient of
the stage input, and BW, the gradient of the weights) or one side of a point-to-point message (SEND_F/RECV_F
carry activations forward, SEND_B/RECV_B carry gradients backward) for one micro-batch at one virtual stage.
Messages are named by the stage that computes with them:

  SEND_F(mb, s): the output of F(mb, s), to the rank of stage s + 1, where it arrives as RECV_F(mb, s + 1)
  SEND_B(mb, s): the input gradient from B/BI(mb, s), to the rank of stage s - 1: RECV_B(mb, s - 1)

Consecutive message actions in a rank's list are one batch, posted together (``comm.send_recv``); messages
between two ranks are matched in the order they are posted, so both sides must list them in the same order.

A generator only decides the order of computations on each rank. `with_communication` then places the
messages: it plays the ranks in lock-step (one computation per rank per slot, each as soon as its inputs
exist) and puts every message into the batch at the end of the slot in which it is produced, on both the
sending and the receiving rank. Both sides therefore list each channel's messages in slot order, receives
are posted as early as the data exists, and neighbours' batches pair up exactly as in Megatron-LM's
``send_forward_recv_backward``. `megaloom.parallel.pipeline.checker` proves the result before anything runs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

from megaloom.errors import ConfigError, ScheduleError
from megaloom.parallel.pipeline.partition import check_schedule_choice
from megaloom.parallel.pipeline.timing import DEFAULT_COSTS


class Kind(StrEnum):
    F = "F"
    B = "B"
    BI = "BI"
    BW = "BW"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"


COMPUTE = frozenset({Kind.F, Kind.B, Kind.BI, Kind.BW})
COMM = frozenset({Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B})


@dataclass(frozen=True)
class Action:
    kind: Kind
    microbatch: int
    stage: int  # the virtual stage; the rank holding it runs it as chunk stage // pp

    def __str__(self) -> str:
        return f"{self.kind.value}(mb={self.microbatch}, stage={self.stage})"

    @property
    def is_comm(self) -> bool:
        return self.kind in COMM


@dataclass(frozen=True)
class Schedule:
    """``ranks[r]`` is pipeline rank r's list of actions for one training step of ``microbatches``."""

    name: str
    pp: int
    vpp: int
    microbatches: int
    ranks: tuple[tuple[Action, ...], ...]
    backward: bool = True  # False: a forward-only (evaluation) schedule

    @property
    def n_stages(self) -> int:
        return self.pp * self.vpp

    def rank_of(self, stage: int) -> int:
        return stage % self.pp

    def steps(self, rank: int) -> list[tuple[Action, ...]]:
        """Rank ``rank``'s list cut into steps: one computation, or one batch of consecutive messages."""
        return group_steps(self.ranks[rank])

    def describe(self) -> str:
        lines = [f"{self.name}: pp={self.pp} vpp={self.vpp} microbatches={self.microbatches}"]
        for r in range(self.pp):
            parts = []
            for step in self.steps(r):
                parts.append("[" + " ".join(_short(a) for a in step) + "]" if step[0].is_comm else _short(step[0]))
            lines.append(f"  rank {r}: " + " ".join(parts))
        return "\n".join(lines)


def _short(a: Action) -> str:
    return f"{a.kind.value}{a.microbatch}.{a.stage}"


def group_steps(actions: Sequence[Action]) -> list[tuple[Action, ...]]:
    steps: list[tuple[Action, ...]] = []
    batch: list[Action] = []
    for a in actions:
        if a.is_comm:
            batch.append(a)
            continue
        if batch:
            steps.append(tuple(batch))
            batch = []
        steps.append((a,))
    if batch:
        steps.append(tuple(batch))
    return steps


# ------------------------------------------------------------------------------------ computation orders


def _gpipe_order(pp: int, m: int) -> list[list[Action]]:
    return [[Action(Kind.F, i, r) for i in range(m)] + [Action(Kind.B, i, r) for i in range(m)]
            for r in range(pp)]


def _one_f_one_b_order(pp: int, m: int) -> list[list[Action]]:
    orders = []
    for r in range(pp):
        warmup = min(pp - r - 1, m)  # stage r has pp - r micro-batches in flight at most
        order = [Action(Kind.F, i, r) for i in range(warmup)]
        for i in range(m - warmup):
            order += [Action(Kind.F, warmup + i, r), Action(Kind.B, i, r)]
        order += [Action(Kind.B, i, r) for i in range(m - warmup, m)]
        orders.append(order)
    return orders


def _interleaved_order(pp: int, vpp: int, m: int) -> list[list[Action]]:
    """Megatron-LM's interleaved 1F1B (``forward_backward_pipelining_with_interleaving``): micro-batches go
    through chunk 0 in groups of pp, then the same group through chunk 1, ...; backward visits the chunks in
    reverse. Rank r warms up with 2 (pp - r - 1) + (vpp - 1) pp forwards, then alternates F and B."""
    total = m * vpp

    def unit(k: int, forward: bool) -> tuple[int, int]:
        group, in_group = divmod(k, pp * vpp)
        chunk = in_group // pp
        return group * pp + k % pp, chunk if forward else vpp - 1 - chunk

    orders = []
    for r in range(pp):
        warmup = min(2 * (pp - r - 1) + (vpp - 1) * pp, total)

        def act(kind: Kind, k: int, r: int = r) -> Action:
            mb, chunk = unit(k, kind == Kind.F)
            return Action(kind, mb, chunk * pp + r)

        order = [act(Kind.F, k) for k in range(warmup)]
        for k in range(total - warmup):
            order += [act(Kind.F, warmup + k), act(Kind.B, k)]
        order += [act(Kind.B, k) for k in range(total - warmup, total)]
        orders.append(order)
    return orders


def _zero_bubble_h1_order(pp: int, m: int, costs: Mapping[str, float]) -> list[list[Action]]:
    """ZB-H1 (Qi et al. 2024, "Zero Bubble Pipeline Parallelism"): 1F1B with B split into BI, the input gradient
    that the previous stage waits for, and BW, the weight gradient that nobody waits for. The order comes from
    playing the pipeline with ``costs``: whenever a rank would idle, it runs a deferred BW. At each decision a
    rank prefers BI (the critical path), then F, then a pending BW; otherwise it waits for the next message.
    Memory stays that of 1F1B's first stage: rank r starts a forward only while fewer than pp - r micro-batches
    wait for BI (as in 1F1B) and fewer than pp wait for BW (whose saved inputs are still held)."""
    f_cost, bi_cost, bw_cost = costs["F"], costs["BI"], costs["BW"]
    free = [0.0] * pp
    n_f, n_bi, n_w = [0] * pp, [0] * pp, [0] * pp
    pending: list[list[int]] = [[] for _ in range(pp)]
    input_at: dict[tuple[int, int], float] = {(mb, 0): 0.0 for mb in range(m)}  # (mb, rank) -> arrival
    grad_at: dict[tuple[int, int], float] = {}
    orders: list[list[Action]] = [[] for _ in range(pp)]

    def options(r: int) -> list[tuple[float, int, Kind]]:
        """(start time, priority, kind) of what rank r could run next, if its inputs are known."""
        out = []
        if n_bi[r] < n_f[r] and (n_bi[r], r) in grad_at:
            out.append((max(free[r], grad_at[(n_bi[r], r)]), 0, Kind.BI))
        room = n_f[r] - n_bi[r] < pp - r and n_f[r] - n_w[r] < pp
        if n_f[r] < m and room and (n_f[r], r) in input_at:
            out.append((max(free[r], input_at[(n_f[r], r)]), 1, Kind.F))
        if pending[r]:
            out.append((free[r], 2, Kind.BW))
        return out

    def choose(r: int) -> tuple[float, int, Kind] | None:
        opts = options(r)
        if not opts:
            return None
        now = [o for o in opts if o[0] <= free[r]]  # ready when the rank is free: take by priority
        return min(now, key=lambda o: o[1]) if now else min(opts)  # else wait for the first arrival

    while any(n_bi[r] < m or pending[r] for r in range(pp)):
        picks = [(c, r) for r in range(pp) if (c := choose(r)) is not None]
        (start, _, kind), r = min(picks, key=lambda p: (p[0][0], p[0][1], p[1]))
        if kind == Kind.F:
            mb, end = n_f[r], start + f_cost
            n_f[r] += 1
            if r + 1 < pp:
                input_at[(mb, r + 1)] = end
            else:
                grad_at[(mb, r)] = end
        elif kind == Kind.BI:
            mb, end = n_bi[r], start + bi_cost
            n_bi[r] += 1
            pending[r].append(mb)
            if r > 0:
                grad_at[(mb, r - 1)] = end
        else:
            mb, end = pending[r].pop(0), start + bw_cost
            n_w[r] += 1
        free[r] = end
        orders[r].append(Action(kind, mb, r))
    return orders


# ---------------------------------------------------------------------------------- placing the messages


def _ready(a: Action, slot: int, done: dict[tuple[str, int, int], int], last: int) -> bool:
    def before(key: tuple[str, int, int]) -> bool:
        return done.get(key, slot) < slot  # finished in an earlier slot

    mb, s = a.microbatch, a.stage
    if a.kind == Kind.F:
        return s == 0 or before(("F", mb, s - 1))
    if a.kind in (Kind.B, Kind.BI):
        return before(("F", mb, s)) and (s == last or before(("B", mb, s + 1)))
    return before(("B", mb, s))  # BW


def with_communication(name: str, pp: int, vpp: int, m: int, orders: list[list[Action]],
                       backward: bool = True) -> Schedule:
    """Add the messages to per-rank computation orders (see the module docstring) and return the schedule."""
    last = pp * vpp - 1
    done: dict[tuple[str, int, int], int] = {}
    placed: list[list[tuple[int, Action]]] = [[] for _ in range(pp)]
    pos, slot = [0] * pp, 0
    while any(pos[r] < len(orders[r]) for r in range(pp)):
        now = [orders[r][pos[r]] for r in range(pp)
               if pos[r] < len(orders[r]) and _ready(orders[r][pos[r]], slot, done, last)]
        if not now:
            waiting = "; ".join(f"rank {r} at {orders[r][pos[r]]}" for r in range(pp) if pos[r] < len(orders[r]))
            raise ScheduleError(f"{name}: the computation order can never proceed (each rank waits for data that "
                                f"is computed after it): {waiting}")
        for a in now:
            r = a.stage % pp
            placed[r].append((slot, a))
            pos[r] += 1
            done[("F" if a.kind == Kind.F else "B" if a.kind in (Kind.B, Kind.BI) else "W", a.microbatch,
                  a.stage)] = slot
        slot += 1

    # Messages: (slot, sender, receiver, send action, receive action)
    events: list[list[tuple[int, int, Action]]] = [[] for _ in range(pp)]  # (slot, order within slot, action)
    for r in range(pp):
        for t, a in placed[r]:
            events[r].append((t, 0, a))
            mb, s = a.microbatch, a.stage
            if a.kind == Kind.F and s < last and (s + 1) % pp != r:
                events[r].append((t, 1, Action(Kind.SEND_F, mb, s)))
                events[(s + 1) % pp].append((t, 2, Action(Kind.RECV_F, mb, s + 1)))
            elif a.kind in (Kind.B, Kind.BI) and s > 0 and (s - 1) % pp != r:
                events[r].append((t, 1, Action(Kind.SEND_B, mb, s)))
                events[(s - 1) % pp].append((t, 2, Action(Kind.RECV_B, mb, s - 1)))
    ranks = tuple(tuple(a for _, _, a in sorted(ev, key=lambda e: (e[0], e[1]))) for ev in events)
    return Schedule(name, pp, vpp, m, ranks, backward)


# ------------------------------------------------------------------------------------------- generators


def gpipe(pp: int, m: int) -> Schedule:
    """All forwards, then all backwards (Huang et al. 2019): m micro-batches' activations in flight."""
    return with_communication("gpipe", pp, 1, m, _gpipe_order(pp, m))


def one_f_one_b(pp: int, m: int) -> Schedule:
    """PipeDream-Flush 1F1B (Narayanan et al. 2021): the bubble of GPipe, at most pp micro-batches in flight."""
    return with_communication("1f1b", pp, 1, m, _one_f_one_b_order(pp, m))


def interleaved(pp: int, vpp: int, m: int) -> Schedule:
    """Megatron-LM's interleaved 1F1B over vpp chunks per rank; needs m to be a multiple of pp."""
    if vpp == 1:
        return with_communication("interleaved", pp, 1, m, _one_f_one_b_order(pp, m))
    if m % pp:
        raise ConfigError(f"the interleaved schedule needs the micro-batch count ({m}) to be a multiple of "
                          f"parallel.pp={pp}; {max(pp, m // pp * pp)} or {(m // pp + 1) * pp} would work.")
    return with_communication("interleaved", pp, vpp, m, _interleaved_order(pp, vpp, m))


def zero_bubble_h1(pp: int, m: int, costs: Mapping[str, float] | None = None) -> Schedule:
    """ZB-H1; the order of BW is planned with ``costs`` (default F = B = 1, BI = BW = 0.5)."""
    return with_communication("zb", pp, 1, m, _zero_bubble_h1_order(pp, m, {**DEFAULT_COSTS, **(costs or {})}))


def forward_only(pp: int, vpp: int, m: int) -> Schedule:
    """Evaluation: every micro-batch through every stage, no backward."""
    orders = [[Action(Kind.F, mb, c * pp + r) for c in range(vpp) for mb in range(m)] for r in range(pp)]
    return with_communication("forward", pp, vpp, m, orders, backward=False)


def build_schedule(name: str, pp: int, vpp: int, m: int) -> Schedule:
    """The schedule called ``name`` (the values of parallel.schedule) for pp ranks, vpp chunks, m micro-batches."""
    check_schedule_choice(name, pp, vpp)
    if m < 1:
        raise ConfigError(f"a pipeline step needs at least one micro-batch, got {m}.")
    if name == "gpipe":
        return gpipe(pp, m)
    if name == "1f1b":
        return one_f_one_b(pp, m)
    if name == "interleaved":
        return interleaved(pp, vpp, m)
    return zero_bubble_h1(pp, m)
