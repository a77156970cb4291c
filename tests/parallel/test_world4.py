"""One world of 4 processes: mesh groups, collectives, region autograd, vocab-parallel CE, dropout streams,
and single-process parity of tp=4 (with n_kv_heads=2: each KV head replicated on two ranks)."""

from __future__ import annotations

import pytest
import torch

from megaloom.parallel.mesh import Mesh, rank_coords

from .checks import (
    assert_collectives,
    assert_element_counts,
    assert_gathered_linears,
    assert_parity,
    assert_regions,
    assert_ring_steps,
    assert_vocab_ce,
)
from .harness import run_world
from .worlds import suite_world4

WORLD = 4
PARITY = ["parity-llama-tp4-sp0", "parity-llama-tp4-sp1", "parity-gpt2-tp4-sp0", "parity-gpt2-tp4-sp1",
          "parity-llama-tp4-sp1-untied", "parity-qwen3-tp4-sp1", "parity-llama-tp4-sp1-async",
          "parity-gpt2-tp4-sp1-async-untied", "parity-llama-tp4-sp1-lora"]


@pytest.fixture(scope="module")
def world() -> list[dict]:
    return run_world(WORLD, suite_world4)


@pytest.mark.parametrize("key,sizes", [("mesh_tp2_ep2", dict(tp=2, pp=1, cp=1, dp=2, ep=2)),
                                       ("mesh_pp2_tp2", dict(tp=2, pp=2, cp=1, dp=1, ep=1)),
                                       ("mesh_dp4_ep2", dict(tp=1, pp=1, cp=1, dp=4, ep=2))])
def test_mesh_groups_match_layout(world: list[dict], key: str, sizes: dict) -> None:
    layout = Mesh.layout(WORLD, sizes)
    for rank, res in enumerate(world):
        m = res[key]
        for kind, members in m["groups"].items():
            assert members == next(g for g in layout[kind] if rank in g), (kind, rank)
        coords = rank_coords(rank, sizes)
        assert m["group_ranks"] == {d: coords[d] for d in ("tp", "pp", "dp", "cp")}
        assert m["ranks"]["ep"] == coords["dp"] % sizes["ep"]
        assert m["sizes"] == {d: sizes[d] for d in ("pp", "dp", "cp", "tp", "ep")}
        assert 0 < m["init_seconds"] < 10
        if sizes["pp"] > 1:
            assert m["received"] == m["pp_prev"]  # sent by the previous stage around the ring
            assert m["first"] == (coords["pp"] == 0) and m["last"] == (coords["pp"] == 1)


def test_collectives(world: list[dict]) -> None:
    assert_collectives([r["collectives"] for r in world], tp=4)


def test_region_autograd(world: list[dict]) -> None:
    for res in world:
        assert_regions(res["regions"])


def test_vocab_parallel_cross_entropy(world: list[dict]) -> None:
    for res in world:
        assert_vocab_ce(res["vocab_ce"])


def test_rng_streams(world: list[dict]) -> None:
    """Mesh tp=2 x dp=2: forked streams differ across tp ranks, the default stream agrees within a tp group
    and differs across dp ranks; a fork replays after the RNG state is restored (checkpointing)."""
    rng = [r["rng"] for r in world]
    for a in rng:
        assert a["replay_err"] == 0.0
        for b in rng:
            if a is b:
                continue
            same_tp_group = a["dp_rank"] == b["dp_rank"]
            assert torch.equal(a["default"], b["default"]) == same_tp_group
            assert not torch.equal(a["forked"], b["forked"])


@pytest.mark.parametrize("case", PARITY)
def test_parity_with_single_process(world: list[dict], case: str) -> None:
    for res in world:
        assert_parity(res[case], tie="untied" not in case)


def test_each_rank_holds_its_share(world: list[dict]) -> None:
    assert_element_counts([r["parity-llama-tp4-sp0"] for r in world], tp=4)


@pytest.mark.parametrize("sp", [0, 1])
def test_dropout_masks_agree_where_they_must(world: list[dict], sp: int) -> None:
    results = [r[f"dropout-sp{sp}"] for r in world]
    for res in results:
        assert res["replay"] == {"selective": 0.0, "full": 0.0}
        for name, grad in res["replicated"].items():
            assert torch.equal(grad, results[0]["replicated"][name]), name


def test_cached_decoding_matches(world: list[dict]) -> None:
    for res in world:
        assert max(res["decode"].values()) < 1e-4, res["decode"]


def test_sequence_parallel_linears_match_and_overlap(world: list[dict]) -> None:
    for res in world:
        assert_gathered_linears(res["gathered_linears"])


def test_async_tp_replaces_the_region_collectives_by_ring_steps(world: list[dict]) -> None:
    for res in world:  # (parity of the async cases is checked above)
        assert_ring_steps(res["parity-llama-tp4-sp1"]["tp_ops"], res["parity-llama-tp4-sp1-async"]["tp_ops"])
