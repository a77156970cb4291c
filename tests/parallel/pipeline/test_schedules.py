"""Schedules as data, proven by the checker, and what simulate() says of their bubbles and memory."""

from __future__ import annotations

import dataclasses

import pytest

from megaloom.config import ConfigError
from megaloom.parallel.pipeline.checker import check_schedule, simulate
from megaloom.parallel.pipeline.schedules import (
    Action,
    Kind,
    Schedule,
    ScheduleError,
    build_schedule,
    forward_only,
    gpipe,
    interleaved,
    one_f_one_b,
    zero_bubble_h1,
)

F, B, BI, BW = Kind.F, Kind.B, Kind.BI, Kind.BW
SF, RF, SB, RB = Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B


def _grid():
    for pp in (1, 2, 3, 4, 8):
        for m in sorted({1, 2, pp, 2 * pp, 3 * pp + 1}):
            for name in ("gpipe", "1f1b", "zb"):
                yield name, pp, 1, m
            for vpp in (2, 3):
                if m % pp == 0:
                    yield "interleaved", pp, vpp, m


def test_every_generated_schedule_is_proven() -> None:
    n = 0
    for name, pp, vpp, m in _grid():
        sc = build_schedule(name, pp, vpp, m)
        check_schedule(sc)
        simulate(sc)
        n += 1
    for pp, vpp, m in ((1, 1, 3), (2, 2, 3), (4, 2, 8)):
        check_schedule(forward_only(pp, vpp, m))
    assert n > 80


def test_schedule_is_data() -> None:
    sc = one_f_one_b(2, 2)
    assert sc.ranks[0] == (Action(F, 0, 0), Action(SF, 0, 0), Action(F, 1, 0), Action(SF, 1, 0), Action(RB, 0, 0),
                           Action(B, 0, 0), Action(RB, 1, 0), Action(B, 1, 0))
    assert "rank 1:" in sc.describe()
    # Steady 1F1B: the neighbours' batches pair up as Megatron's send_forward_recv_backward and
    # send_backward_recv_forward (each receive is posted in the batch where its sender sends).
    sc = one_f_one_b(2, 4)
    assert (Action(SF, 2, 0), Action(RB, 1, 0)) in sc.steps(0)
    assert (Action(SB, 1, 1), Action(RF, 2, 1)) in sc.steps(1)


def _with(sc: Schedule, rank: int, actions: list[Action]) -> Schedule:
    ranks = list(sc.ranks)
    ranks[rank] = tuple(actions)
    return dataclasses.replace(sc, ranks=tuple(ranks))


def test_checker_rejects_missing_dependencies() -> None:
    sc = one_f_one_b(2, 2)
    r1 = list(sc.ranks[1])
    no_recv = [a for a in r1 if a != Action(RF, 1, 1)]  # F(1) on stage 1 without its input
    with pytest.raises(ScheduleError, match=r"rank 1, action #\d+ F\(mb=1, stage=1\): its input has not arrived: "
                                            r"needs RECV_F\(mb=1, stage=1\) from rank 0"):
        check_schedule(_with(sc, 1, no_recv))
    r0 = list(sc.ranks[0])
    early_b = [Action(RB, 0, 0), Action(B, 0, 0)] + [a for a in r0 if a not in (Action(RB, 0, 0), Action(B, 0, 0))]
    with pytest.raises(ScheduleError, match=r"rank 0, action #1 B\(mb=0, stage=0\): runs before its forward"):
        check_schedule(_with(sc, 0, early_b))
    # B of stage 0 before the gradient from stage 1 arrived (the backward of stage s + 1 must come first)
    grad_late = [a for a in r0 if a != Action(RB, 0, 0)]
    grad_late.insert(grad_late.index(Action(B, 0, 0)) + 1, Action(RB, 0, 0))
    with pytest.raises(ScheduleError, match=r"output gradient has not arrived: needs RECV_B\(mb=0, stage=0\)"):
        check_schedule(_with(sc, 0, grad_late))
    zb = zero_bubble_h1(2, 2)
    r0 = [a for a in zb.ranks[0] if a != Action(BW, 0, 0)]
    r0.insert(r0.index(Action(BI, 0, 0)), Action(BW, 0, 0))
    with pytest.raises(ScheduleError, match=r"BW\(mb=0, stage=0\): runs before BI\(mb=0, stage=0\)"):
        check_schedule(_with(zb, 0, r0))
    dropped = [a for a in sc.ranks[1] if a != Action(B, 1, 1)]
    with pytest.raises(ScheduleError, match=r"SEND_B\(mb=1, stage=1\): sends a gradient that the backward"):
        check_schedule(_with(sc, 1, dropped))
    no_send = [a for a in sc.ranks[0] if a != Action(SF, 1, 0)]
    with pytest.raises(ScheduleError, match=r"rank 0 never runs SEND_F\(mb=1, stage=0\), which stage 0 needs"):
        check_schedule(_with(sc, 0, no_send))
    with pytest.raises(ScheduleError, match="stage 1 lives on rank 1"):
        check_schedule(_with(sc, 0, list(sc.ranks[0]) + [Action(F, 0, 1)]))


def test_checker_rejects_mismatched_message_order() -> None:
    sc = gpipe(2, 2)
    r0 = list(sc.ranks[0])
    i, j = r0.index(Action(SF, 0, 0)), r0.index(Action(SF, 1, 0))
    r0[i], r0[j] = r0[j], r0[i]  # sends swapped: would deliver micro-batch 1's activation as micro-batch 0's
    with pytest.raises(ScheduleError, match="SEND_F"):
        check_schedule(_with(sc, 0, r0))
    r0 = list(sc.ranks[0])
    r0[i], r0[i + 1] = r0[i + 1], r0[i]  # F(1) ... moved before SEND_F(0): fine, order of sends unchanged
    check_schedule(_with(sc, 0, r0))


def test_checker_rejects_a_deadlock() -> None:
    """Stage 0 runs 1F1B (waits for micro-batch 0's gradient before sending micro-batch 1) while stage 1 wants
    both forwards before any backward: every dependency and message order is right, yet neither can move."""
    ranks = ((Action(F, 0, 0), Action(SF, 0, 0), Action(RB, 0, 0), Action(B, 0, 0), Action(F, 1, 0),
              Action(SF, 1, 0), Action(RB, 1, 0), Action(B, 1, 0)),
             (Action(RF, 0, 1), Action(F, 0, 1), Action(RF, 1, 1), Action(F, 1, 1), Action(B, 0, 1),
              Action(SB, 0, 1), Action(B, 1, 1), Action(SB, 1, 1)))
    sc = Schedule("bad", 2, 1, 2, ranks)
    with pytest.raises(ScheduleError) as e:
        check_schedule(sc)
    msg = str(e.value)
    assert "deadlocks" in msg
    assert "rank 0 blocks in batch [SEND_F(mb=0, stage=0), RECV_B(mb=0, stage=0)] waiting for RECV_B" in msg
    assert "rank 1 blocks in batch [RECV_F(mb=1, stage=1)]" in msg


@pytest.mark.parametrize("pp,m", [(2, 2), (2, 8), (4, 4), (4, 8), (4, 16), (8, 8)])
def test_planned_bubble_of_gpipe_and_1f1b(pp: int, m: int) -> None:
    expected = (pp - 1) / (m + pp - 1)
    for sc in (gpipe(pp, m), one_f_one_b(pp, m)):
        tl = simulate(sc)
        assert tl.bubble_fraction == pytest.approx(expected, abs=1e-12)
        assert tl.bubble_ratio == pytest.approx((pp - 1) / m, abs=1e-12)
        assert tl.makespan == pytest.approx(2 * (m + pp - 1))


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 4), (4, 8), (4, 16), (8, 16)])
def test_interleaved_and_zero_bubble_have_less(pp: int, m: int) -> None:
    base = simulate(one_f_one_b(pp, m)).bubble_fraction
    for vpp in (2, 4):
        tl = simulate(interleaved(pp, vpp, m))
        assert tl.bubble_fraction < base
        assert tl.bubble_ratio == pytest.approx((pp - 1) / (vpp * m), abs=1e-12)  # Megatron's (p - 1) / (v m)
    zb = simulate(zero_bubble_h1(pp, m))
    assert zb.bubble_fraction < base
    # ZB-H1's bubble (p - 1)(T_F + T_BI - T_BW) = p - 1 units here, half of 1F1B's (p - 1)(T_F + T_B)
    assert zb.makespan * pp - 2 * m * pp == pytest.approx((pp - 1) * pp, abs=1e-9)


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 4), (4, 8), (4, 12), (8, 16)])
def test_memory_bounds(pp: int, m: int) -> None:
    assert simulate(gpipe(pp, m)).peak_activations == [m] * pp
    one = simulate(one_f_one_b(pp, m))
    assert one.peak_activations[0] == min(pp, m)  # at most pp micro-batches in flight at stage 0
    assert one.peak_activations == [min(pp - r, m) for r in range(pp)]
    zb = simulate(zero_bubble_h1(pp, m))
    assert zb.peak_activations == one.peak_activations  # same forwards in flight as 1F1B
    assert max(zb.peak_unfinished) <= pp  # weight gradients deferred, but never past 1F1B's first stage
    for vpp in (2, 3):
        tl = simulate(interleaved(pp, vpp, m))  # counted in (micro-batch, chunk) units
        bound = [min(2 * (pp - r - 1) + (vpp - 1) * pp + 1, m * vpp) for r in range(pp)]
        assert all(p <= b for p, b in zip(tl.peak_activations, bound, strict=True)), (tl.peak_activations, bound)


def test_generators_reject_what_they_cannot_run() -> None:
    with pytest.raises(ConfigError, match="multiple of parallel.pp=4"):
        interleaved(4, 2, 6)
    with pytest.raises(ConfigError, match="needs parallel.schedule=interleaved"):
        build_schedule("zb", 4, 2, 8)
    with pytest.raises(ConfigError, match="at least one micro-batch"):
        build_schedule("1f1b", 4, 1, 0)
