"""Muon (megaloom/optim/muon.py) at every layout against the single process, in two worlds started once each
(2 and 4 gloo processes): tp2, dp2 with ZeRO 0/1/2, ep2 (MoE) with ZeRO 0/1, tp2 x dp2 with ZeRO 0/1/2, tp4 (KV heads
replicated over tp ranks); QK-clip (megaloom/optim/qk_clip.py) at tp2, dp2 ZeRO-1, tp2 x dp2 ZeRO-1 and tp4; the
pipeline (pp2, pp2 x dp2 ZeRO 0/1, through TrainStep); and checkpoints resumed exactly at another layout (dp2
ZeRO-1 -> tp2; tp2 x dp2 ZeRO-2 -> dp4 ZeRO-1). Newton-Schulz in fp32: every parameter within 1e-5 of the single
process after every step."""

from __future__ import annotations

import pytest

from megaloom.planning.comm import muon_bytes
from megaloom.planning.step import muon_matrices

from .harness import run_world
from .muon_worlds import MOE, suite_muon2, suite_muon4
from .worlds import tiny_config

TOL = 1e-5
PARITY2 = ["tp2-z0", "dp2-z0", "dp2-z1", "dp2-z2", "ep2-z0", "ep2-z1", "tp2-z0-clip", "dp2-z1-clip"]
PARITY4 = ["tp2dp2-z0", "tp2dp2-z1", "tp2dp2-z2", "tp4-z0", "tp2dp2-z1-clip", "tp4-z0-clip"]
PIPELINE = [("world2", "pp2-z0"), ("world4", "pp2dp2-z0"), ("world4", "pp2dp2-z1")]


@pytest.fixture(scope="module")
def world2(tmp_path_factory) -> list[dict]:
    return run_world(2, suite_muon2, str(tmp_path_factory.mktemp("muon2")))


@pytest.fixture(scope="module")
def world4(tmp_path_factory) -> list[dict]:
    return run_world(4, suite_muon4, str(tmp_path_factory.mktemp("muon4")))


def _check_parity(world: list[dict], case: str) -> None:
    for rank, res in enumerate(world):
        r = res[case]
        assert max(r["errors"]) < TOL, (case, rank, r["errors"])
        assert r["moved"] > 100 * TOL  # the weights did move: the comparison is not vacuous
        assert "momentum_buffer" in r["state_keys"] and "exp_avg" in r["state_keys"], r["state_keys"]
        if case.endswith("-clip"):  # QK-clip: the single process clipped some heads, and so did this layout
            assert r["ref_clipped"] > 0 and r["clipped"] > 0, (case, rank, r["ref_clipped"], r["clipped"])


@pytest.mark.parametrize("case", PARITY2)
def test_muon_layout_equals_single_process_world2(world2: list[dict], case: str) -> None:
    _check_parity(world2, case)


@pytest.mark.parametrize("case", PARITY4)
def test_muon_layout_equals_single_process_world4(world4: list[dict], case: str) -> None:
    _check_parity(world4, case)


@pytest.mark.parametrize(("world_name", "case"), PIPELINE)
def test_muon_through_the_pipeline_equals_single_process(request, world_name: str, case: str) -> None:
    """pp2 (1F1B, 4 micro-batches, clipped gradients, TrainStep): every step's loss and gradient norm, and the
    weights after 4 steps, within 1e-5 of the single process."""
    for rank, res in enumerate(request.getfixturevalue(world_name)):
        r = res[case]
        for got, want in zip(r["loss"] + r["norm"], r["loss_ref"] + r["norm_ref"], strict=True):
            assert abs(got - want) <= 1e-5 * abs(want), (case, rank, r["loss"], r["loss_ref"], r["norm"])
        assert r["param_err"] < TOL, (case, rank, r["param_err"])


@pytest.mark.parametrize(("world_name", "case", "tp", "ep", "zero"), [
    ("world2", "tally-tp2-z0", 2, 1, 0), ("world2", "tally-ep2-z1", 1, 2, 1), ("world4", "tally-tp2dp2-z1", 2, 1, 1)])
def test_the_planner_counts_the_bytes_the_exchange_sends(request, world_name, case, tp, ep, zero) -> None:
    """planning/comm.py's `muon_bytes` of the config's matrices (planning/step.py's `muon_matrices`) equals what a
    comm.CommTally recorded on the gloo world's ranks in one step, summed over the ranks, op by op."""
    world = request.getfixturevalue(world_name)
    measured: dict[str, int] = {}
    for res in world:
        for key, n in res[case].items():
            measured[key] = measured.get(key, 0) + n
    cfg = tiny_config(tp=tp, ep=ep, world=len(world), extra=MOE if ep > 1 else ())
    planned = muon_bytes(muon_matrices(cfg, list(range(cfg.model.n_layers))), tp, len(world) // tp, ep, zero)
    assert measured and {f"{g} {op}": n for (g, op), n in planned.items()} == measured, (planned, measured)


def test_owners_spread_the_gather_buffers(world4: list[dict]) -> None:
    """Under tp2 x dp2 with ZeRO the owners are spread round-robin: every rank orthogonalised some matrix."""
    for res in world4:
        assert res["tp2dp2-z1"]["gather"] > 0


@pytest.mark.parametrize(("world_name", "case"), [("world2", "dp2-z1-to-tp2-z0"),
                                                  ("world4", "tp2dp2-z2-to-dp4-z1")])
def test_muon_resume_is_exact_at_another_layout(request, world_name: str, case: str) -> None:
    for res in request.getfixturevalue(world_name):
        r = res[case]
        assert max(r["first"]) < TOL and max(r["resumed"]) < TOL, r
        assert r["resumed_steps"] == [3.0], r["resumed_steps"]
        assert max(r["zeroed"]) > 100 * TOL, r["zeroed"]  # without the loaded momentum the run differs
