"""Expert parallelism in one world of 4 processes: the all-to-all dispatch followed by combine is the local
dispatch/combine (the identity on tokens when nothing is dropped), and an MoE layer split over ep (2, 4),
with tp=2 and sequence parallelism, reproduces the full layer: outputs, input and every parameter gradient."""

from __future__ import annotations

import pytest

from .expert_worlds import suite_expert_world4
from .harness import run_world

CASES = ["layer-ep2", "layer-ep2-cap", "layer-ep4", "layer-ep4-cap", "layer-tp2-ep2-sp0", "layer-tp2-ep2-sp1",
         "layer-tp2-ep1-sp1"]


@pytest.fixture(scope="module")
def world() -> list[dict]:
    return run_world(4, suite_expert_world4)


@pytest.mark.parametrize("ep", [2, 4])
def test_dispatch_then_combine_is_identity(world: list[dict], ep: int) -> None:
    rows = 0
    for res in world:
        r = res[f"identity-ep{ep}"]
        assert r["err"] < 1e-6 and r["err_x"] < 1e-6 and r["grad_err"] < 1e-6, r
        assert len(r["local_counts"]) == 8 // ep  # rows arrive grouped by this rank's experts
        rows += r["rows"]
        capped = res[f"identity-ep{ep}-cap"]
        assert capped["err"] < 1e-6 and capped["grad_err"] < 1e-6 and capped["dropped"] > 0, capped
    assert rows == 4 * 24 * 2  # every (token, expert) pair of every rank reached exactly one expert


@pytest.mark.parametrize("case", CASES)
def test_moe_layer_matches_full_layer(world: list[dict], case: str) -> None:
    for rank, res in enumerate(world):
        r = res[case]
        assert r["out_err"] < 1e-5, (rank, r["out_err"])
        for name, (err, scale, _local, _full) in r["grads"].items():
            assert err <= 1e-5 * max(1.0, scale), (rank, name, err, scale)
        if case.endswith("cap") or "tp2-ep2" in case:
            assert r["dropped"] > 0  # capacity 1.0 on random routing drops some assignments
    shapes = world[0][case]["grads"]["experts.w_gate"]
    assert shapes[3] == (8, 16, 32)  # gathered back to the full [E, D, F]
    ep = 4 if "ep4" in case else 1 if "ep1" in case else 2
    tp = 2 if "tp2" in case else 1
    assert shapes[2] == (8 // ep, 16, 32 // tp)
