"""Prove a schedule before anything runs: every computation has its data, every message is matched, no rank
waits forever. And play it with costs to get the planned timeline, bubble and activation memory.

`check_schedule` runs four passes and raises `ScheduleError` on the first violation, naming the rank, the
position in its list and what is missing:

1. shape: each action belongs to a stage of its rank, a message goes to another rank, indices are in range;
2. dependencies, walking each rank's list in order: F(mb, s) after its input arrived (RECV_F, or F(mb, s - 1)
   on the same rank, or tokens for s = 0); B/BI after this stage's F and after the output gradient arrived
   (RECV_B, or the next stage's backward on the same rank, or the loss for the last stage); BW after BI;
   a SEND after the computation that produces it; then every (micro-batch, stage) complete exactly once;
3. messages: on every channel (sender -> receiver) the k-th send and the k-th receive are the same message
   (point-to-point messages are matched in posting order, and all have the same shape, so a mismatch would
   silently swap tensors);
4. deadlock: the ranks' lists played with blocking semantics (a batch of messages completes only when every
   peer has posted the matching operation, sends included: NCCL may rendezvous), until all finish or none
   can move. A schedule that passes also runs when sends return early and receives are waited on late,
   which is what the executor does.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping

from megaloom.parallel.pipeline.schedules import COMPUTE, Action, Kind, Schedule, ScheduleError
from megaloom.parallel.pipeline.timing import DEFAULT_COSTS, TimedAction, Timeline

COMPUTE_NAMES = frozenset(k.value for k in COMPUTE)


def _counterpart(a: Action) -> Action:
    """The receive that matches a send."""
    if a.kind == Kind.SEND_F:
        return Action(Kind.RECV_F, a.microbatch, a.stage + 1)
    return Action(Kind.RECV_B, a.microbatch, a.stage - 1)


def peer_of(a: Action, pp: int) -> int:
    """The rank at the other end of a message action."""
    if a.kind in (Kind.SEND_F, Kind.RECV_B):
        return (a.stage + 1) % pp
    return (a.stage - 1) % pp


def check_schedule(schedule: Schedule) -> None:
    _check_shape(schedule)
    for r in range(schedule.pp):
        _check_dependencies(schedule, r)
    _check_channels(schedule)
    _check_deadlock(schedule)


def _fail(schedule: Schedule, rank: int, index: int, action: Action, why: str) -> ScheduleError:
    return ScheduleError(f"{schedule.name} (pp={schedule.pp} vpp={schedule.vpp} m={schedule.microbatches}): "
                         f"rank {rank}, action #{index} {action}: {why}")


def _check_shape(sc: Schedule) -> None:
    if len(sc.ranks) != sc.pp:
        raise ScheduleError(f"{sc.name}: {len(sc.ranks)} rank lists for pp={sc.pp}.")
    last = sc.n_stages - 1
    for r, actions in enumerate(sc.ranks):
        for i, a in enumerate(actions):
            if not 0 <= a.microbatch < sc.microbatches:
                raise _fail(sc, r, i, a, f"micro-batch outside 0..{sc.microbatches - 1}")
            if not 0 <= a.stage <= last:
                raise _fail(sc, r, i, a, f"stage outside 0..{last}")
            if sc.rank_of(a.stage) != r:
                raise _fail(sc, r, i, a, f"stage {a.stage} lives on rank {sc.rank_of(a.stage)}")
            if a.kind in (Kind.B, Kind.BI, Kind.BW) and not sc.backward:
                raise _fail(sc, r, i, a, "backward in a forward-only schedule")
            if a.is_comm:
                beyond = (a.kind in (Kind.SEND_F, Kind.RECV_B) and a.stage == last) or \
                         (a.kind in (Kind.RECV_F, Kind.SEND_B) and a.stage == 0)
                if beyond:
                    raise _fail(sc, r, i, a, "no stage on the other end of this message")
                if peer_of(a, sc.pp) == r:
                    raise _fail(sc, r, i, a, "a message to this rank itself (neighbouring stages on one rank "
                                             "pass data locally)")


def _check_dependencies(sc: Schedule, r: int) -> None:
    last, pp = sc.n_stages - 1, sc.pp
    seen: set[tuple[Kind, int, int]] = set()

    def has(kind: Kind, mb: int, s: int) -> bool:
        return (kind, mb, s) in seen

    for i, a in enumerate(sc.ranks[r]):
        mb, s, k = a.microbatch, a.stage, a.kind
        if has(k, mb, s):
            raise _fail(sc, r, i, a, "appears twice")
        if k == Kind.F:
            if s > 0 and not (has(Kind.RECV_F, mb, s) or (pp == 1 and has(Kind.F, mb, s - 1))):
                src = f"F(mb={mb}, stage={s - 1}) on this rank" if pp == 1 else \
                    f"RECV_F(mb={mb}, stage={s}) from rank {(s - 1) % pp}"
                raise _fail(sc, r, i, a, f"its input has not arrived: needs {src} first")
        elif k in (Kind.B, Kind.BI):
            if not has(Kind.F, mb, s):
                raise _fail(sc, r, i, a, f"runs before its forward F(mb={mb}, stage={s})")
            if has(Kind.B, mb, s) or has(Kind.BI, mb, s):
                raise _fail(sc, r, i, a, "a second backward for this micro-batch and stage")
            got = s == last or has(Kind.RECV_B, mb, s) or \
                (pp == 1 and (has(Kind.B, mb, s + 1) or has(Kind.BI, mb, s + 1)))
            if not got:
                src = f"the backward of stage {s + 1} on this rank" if pp == 1 else \
                    f"RECV_B(mb={mb}, stage={s}) from rank {(s + 1) % pp}, after the backward of stage {s + 1}"
                raise _fail(sc, r, i, a, f"its output gradient has not arrived: needs {src} first")
        elif k == Kind.BW:
            if not has(Kind.BI, mb, s):
                raise _fail(sc, r, i, a, f"runs before BI(mb={mb}, stage={s}) (weight gradients need the "
                                         "input-gradient pass first)")
        elif k == Kind.SEND_F and not has(Kind.F, mb, s):
            raise _fail(sc, r, i, a, f"sends an activation that F(mb={mb}, stage={s}) has not computed yet")
        elif k == Kind.SEND_B and not (has(Kind.B, mb, s) or has(Kind.BI, mb, s)):
            raise _fail(sc, r, i, a, f"sends a gradient that the backward of (mb={mb}, stage={s}) has not "
                                     "computed yet")
        seen.add((k, mb, s))

    for s in [st for st in range(sc.n_stages) if st % pp == r]:
        for mb in range(sc.microbatches):
            need = [Kind.F]
            if s > 0 and pp > 1:
                need.append(Kind.RECV_F)
            if s < last and pp > 1:
                need.append(Kind.SEND_F)
            if sc.backward:
                split = has(Kind.BI, mb, s) or has(Kind.BW, mb, s)
                need += [Kind.BI, Kind.BW] if split else [Kind.B]
                if s > 0 and pp > 1:
                    need.append(Kind.SEND_B)
                if s < last and pp > 1:
                    need.append(Kind.RECV_B)
            for kind in need:
                if not has(kind, mb, s):
                    raise ScheduleError(f"{sc.name} (pp={sc.pp} vpp={sc.vpp} m={sc.microbatches}): rank {r} never "
                                        f"runs {Action(kind, mb, s)}, which stage {s} needs.")


def _check_channels(sc: Schedule) -> None:
    sends: dict[tuple[int, int], list[Action]] = defaultdict(list)
    recvs: dict[tuple[int, int], list[Action]] = defaultdict(list)
    for r, actions in enumerate(sc.ranks):
        for a in actions:
            if a.kind in (Kind.SEND_F, Kind.SEND_B):
                sends[(r, peer_of(a, sc.pp))].append(a)
            elif a.kind in (Kind.RECV_F, Kind.RECV_B):
                recvs[(peer_of(a, sc.pp), r)].append(a)
    for src, dst in sorted(set(sends) | set(recvs)):
        out, inc = sends[(src, dst)], recvs[(src, dst)]
        for k in range(max(len(out), len(inc))):
            sent = _counterpart(out[k]) if k < len(out) else None
            got = inc[k] if k < len(inc) else None
            if sent != got:
                raise ScheduleError(
                    f"{sc.name}: messages from rank {src} to rank {dst} are matched in posting order, but message "
                    f"#{k} is {out[k] if k < len(out) else 'nothing'} on rank {src} while rank {dst}'s receive "
                    f"#{k} from it is {got or 'nothing'}; both sides must list the messages in the same order.")


def _channel_index(sc: Schedule) -> list[list[tuple[tuple[int, int], int, bool]]]:
    """For each rank's actions: (channel, position on that channel, is_send); channel None for computations."""
    count: dict[tuple[tuple[int, int], bool], int] = defaultdict(int)
    out = []
    for r, actions in enumerate(sc.ranks):
        row = []
        for a in actions:
            if not a.is_comm:
                row.append(None)
                continue
            send = a.kind in (Kind.SEND_F, Kind.SEND_B)
            ch = (r, peer_of(a, sc.pp)) if send else (peer_of(a, sc.pp), r)
            row.append((ch, count[(ch, send)], send))
            count[(ch, send)] += 1
        out.append(row)
    return out


def _check_deadlock(sc: Schedule) -> None:
    """Blocking semantics: a rank posts its current batch and moves on only once every op in it is matched."""
    index = _channel_index(sc)
    steps = [sc.steps(r) for r in range(sc.pp)]
    starts = []  # position in the flat list where each step begins
    for r in range(sc.pp):
        pos, row = 0, []
        for st in steps[r]:
            row.append(pos)
            pos += len(st)
        starts.append(row)
    cur = [0] * sc.pp
    posted: dict[tuple[tuple[int, int], bool], int] = defaultdict(int)  # ops posted per channel and side
    posted_step = [-1] * sc.pp

    def post(r: int) -> None:
        if posted_step[r] == cur[r]:
            return
        posted_step[r] = cur[r]
        p0 = starts[r][cur[r]]
        for j in range(len(steps[r][cur[r]])):
            info = index[r][p0 + j]
            if info is not None:
                posted[(info[0], info[2])] = max(posted[(info[0], info[2])], info[1] + 1)

    def matched(r: int) -> list[int]:
        """Positions (in rank r's list) of the current batch's ops still waiting for their peer."""
        p0 = starts[r][cur[r]]
        waiting = []
        for j in range(len(steps[r][cur[r]])):
            ch, k, send = index[r][p0 + j]
            if posted[(ch, not send)] <= k:
                waiting.append(p0 + j)
        return waiting

    moved = True
    while moved:
        moved = False
        for r in range(sc.pp):
            while cur[r] < len(steps[r]):
                step = steps[r][cur[r]]
                if step[0].is_comm:
                    post(r)
                    if matched(r):
                        break
                cur[r] += 1
                moved = True
    stuck = [r for r in range(sc.pp) if cur[r] < len(steps[r])]
    if stuck:
        details = []
        for r in stuck:
            step = steps[r][cur[r]]
            waits = ", ".join(f"{sc.ranks[r][p]} (rank {peer_of(sc.ranks[r][p], sc.pp)} has not posted the other "
                              f"side)" for p in matched(r))
            details.append(f"rank {r} blocks in batch [{', '.join(map(str, step))}] waiting for {waits}")
        raise ScheduleError(f"{sc.name} (pp={sc.pp} vpp={sc.vpp} m={sc.microbatches}) deadlocks: "
                            + "; ".join(details) + ".")


# ------------------------------------------------------------------------------------------- simulation


def simulate(schedule: Schedule, costs: Mapping[str, float] | None = None) -> Timeline:
    """The planned timeline: each computation takes ``costs[kind]`` (default F = B = 1, BI = BW = 0.5), a
    message batch ``costs["COMM"]`` (default 0). As in the executor, sends never block and a computation waits
    only for the message it consumes (receives are posted early and waited on late). Also counts the
    activations each rank holds (see `Timeline`). Run `check_schedule` first: an unchecked schedule may not
    finish."""
    c = {**DEFAULT_COSTS, **(costs or {})}
    sc = schedule
    index = _channel_index(sc)
    steps = [sc.steps(r) for r in range(sc.pp)]
    clock = [0.0] * sc.pp
    cur, pos = [0] * sc.pp, [0] * sc.pp
    sent_at: dict[tuple[tuple[int, int], int], float] = {}
    posted_recv: dict[tuple[Kind, int, int], tuple[tuple[int, int], int]] = {}  # consumer -> (channel, k)
    timeline: list[list[TimedAction]] = [[] for _ in range(sc.pp)]
    live, unfinished = [0] * sc.pp, [0] * sc.pp
    peak_live, peak_unfinished = [0] * sc.pp, [0] * sc.pp
    moved = True
    while moved:
        moved = False
        for r in range(sc.pp):
            while cur[r] < len(steps[r]):
                step = steps[r][cur[r]]
                start = clock[r]
                if step[0].is_comm:
                    end = start + c["COMM"]
                    for j, a in enumerate(step):
                        ch, k, send = index[r][pos[r] + j]
                        if send:
                            sent_at[(ch, k)] = end
                        else:
                            consumer = Kind.F if a.kind == Kind.RECV_F else Kind.B
                            posted_recv[(consumer, a.microbatch, a.stage)] = (ch, k)
                    if end > start:
                        timeline[r].append(TimedAction(r, "COMM", -1, -1, start, end, " ".join(map(str, step))))
                else:
                    a = step[0]
                    consumer = Kind.F if a.kind == Kind.F else Kind.B if a.kind in (Kind.B, Kind.BI) else None
                    msg = posted_recv.get((consumer, a.microbatch, a.stage)) if consumer else None
                    if msg is not None:
                        if msg not in sent_at:
                            break  # its sender has not got there yet: simulate the other ranks first
                        start = max(start, sent_at[msg])
                    end = start + c[a.kind.value]
                    timeline[r].append(TimedAction(r, a.kind.value, a.microbatch, a.stage, start, end))
                    if a.kind == Kind.F and sc.backward:
                        live[r] += 1
                        unfinished[r] += 1
                    elif a.kind in (Kind.B, Kind.BI):
                        live[r] -= 1
                    if a.kind in (Kind.B, Kind.BW):
                        unfinished[r] -= 1
                    peak_live[r] = max(peak_live[r], live[r])
                    peak_unfinished[r] = max(peak_unfinished[r], unfinished[r])
                clock[r] = end
                pos[r] += len(step)
                cur[r] += 1
                moved = True
    if any(cur[r] < len(steps[r]) for r in range(sc.pp)):
        raise ScheduleError(f"{sc.name}: the simulation stopped early; run check_schedule for the reason.")
    return Timeline(sc.name, sc.pp, sc.vpp, sc.microbatches, timeline, "step", peak_live, peak_unfinished)
