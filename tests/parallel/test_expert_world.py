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


def test_sequence_parallel_ranks_dispatch_only_their_own_tokens(world: list[dict]) -> None:
    """tp=2 with sp x ep=2: each tp rank sends its sequence shard's (token, expert) rows over ep, so the ep group's
    all-to-all bytes per rank fall by the tp factor: the two tp ranks' rows add up to what each rank sent without
    sp, where both sent all of them (same tokens, same routing, same capacity drops). The recorder's bytes."""
    counts = 8 * 8  # the per-expert counts exchange (E int64, once per dispatch, identical in both layouts)
    for dp in (0, 1):  # ranks 2dp, 2dp+1 are the tp pair of data-parallel rank dp
        pair = [world[2 * dp + t] for t in (0, 1)]
        full = [r["layer-tp2-ep2-sp0"]["ep_bytes"]["all_to_all"] - counts for r in pair]
        split = [r["layer-tp2-ep2-sp1"]["ep_bytes"]["all_to_all"] - counts for r in pair]
        assert full[0] == full[1] > 0  # without sp every tp rank dispatches every token
        assert split[0] + split[1] == full[0], (split, full)
        assert max(split) < full[0]
        # the rows reach both tp ranks (each holds half of every expert's hidden units) over the tp group instead
        assert pair[0]["layer-tp2-ep2-sp1"]["tp_bytes"]["all_to_all"] > 0
