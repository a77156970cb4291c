"""Muon (megaloom/optim/muon.py) at every layout against the single process, in two worlds started once each
(2 and 4 gloo processes): tp2, dp2 with ZeRO 0/1/2, ep2 (MoE) with ZeRO 0/1, tp2 x dp2 with ZeRO 0/1/2, tp4 (KV heads
replicated over tp ranks), and checkpoints resumed exactly at another layout (dp2 ZeRO-1 -> tp2; tp2 x dp2 ZeRO-2 ->
dp4 ZeRO-1). Newton-Schulz in fp32: every parameter within 1e-5 of the single process after every step."""

from __future__ import annotations

import pytest

from .harness import run_world
from .muon_worlds import suite_muon2, suite_muon4

TOL = 1e-5
PARITY2 = ["tp2-z0", "dp2-z0", "dp2-z1", "dp2-z2", "ep2-z0", "ep2-z1"]
PARITY4 = ["tp2dp2-z0", "tp2dp2-z1", "tp2dp2-z2", "tp4-z0"]


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


@pytest.mark.parametrize("case", PARITY2)
def test_muon_layout_equals_single_process_world2(world2: list[dict], case: str) -> None:
    _check_parity(world2, case)


@pytest.mark.parametrize("case", PARITY4)
def test_muon_layout_equals_single_process_world4(world4: list[dict], case: str) -> None:
    _check_parity(world4, case)


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
