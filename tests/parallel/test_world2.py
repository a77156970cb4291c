"""One world of 2 processes: single-process parity of tp=2 (KV heads split, not replicated)."""

from __future__ import annotations

import pytest
import torch

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
from .worlds import suite_world2

PARITY = ["parity-llama-tp2-sp0", "parity-llama-tp2-sp1", "parity-gpt2-tp2-sp0", "parity-gpt2-tp2-sp1",
          "parity-qwen3-tp2-sp0", "parity-qwen3-tp2-sp1", "parity-gpt2-tp2-sp0-untied", "parity-llama-tp2-sp1-docs",
          "parity-gpt2-tp2-sp1-docs-reset", "parity-qwen3-tp2-sp1-async", "parity-llava-tp2-sp0",
          "parity-llava-tp2-sp1", "parity-bert-tp2-sp0", "parity-bert-tp2-sp1", "parity-t5-tp2-sp0",
          "parity-t5-tp2-sp1", "parity-bert-sop-tp2-sp0", "parity-bert-sop-tp2-sp1", "parity-llama-tp2-sp0-lora",
          "parity-llama-tp2-sp1-lora", "parity-qwen3-tp2-sp1-hd24", "parity-llama-tp2-sp0-hd24-kv1",
          "parity-gemma-tp2-sp0", "parity-gemma-tp2-sp1", "parity-mla-tp2-sp1", "parity-mla-tp2-sp0",
          "parity-mla-tp2-sp1-async", "parity-mtp-tp2-sp1"]


COMPILED = ["parity-llama-tp2-sp1-compiled", "parity-qwen3-tp2-sp1-compiled", "parity-gpt2-tp2-sp0-compiled",
            "parity-mla-tp2-sp1-compiled"]  # latent attention: its down-projections replicated, heads split


@pytest.fixture(scope="module")
def world() -> list[dict]:
    return run_world(2, suite_world2)


@pytest.mark.parametrize("case", PARITY)
def test_parity_with_single_process(world: list[dict], case: str) -> None:
    for res in world:
        assert_parity(res[case], tie="untied" not in case)


@pytest.mark.parametrize("case", COMPILED)
def test_compiled_blocks_are_one_graph_and_match_the_single_process(world: list[dict], case: str) -> None:
    """Compiled tensor-parallel blocks (the borders traced as functional collectives, parallel/borders.py):
    no graph break, one graph for every block (grad mode; a second for the no-grad logits check), and the same
    losses and gradients as the eager single process."""
    for res in world:
        assert res[case]["graph_breaks"] == 0, res[case]["graph_breaks"]
        assert res[case]["graphs"] <= 2, res[case]["graphs"]
        assert_parity(res[case])


@pytest.mark.parametrize("case", ["compiled-saves-sp1-lean0", "compiled-saves-sp1-lean1", "compiled-saves-sp0-lean0"])
def test_the_memory_plan_knows_what_compiled_tp_blocks_save(world: list[dict], case: str) -> None:
    """The plan's compiled save-set at tp 2 (with sp: the normed inputs kept all-gathered, lean or not) is what
    Inductor's partitioner saves, byte for byte."""
    for res in world:
        assert res[case]["measured"] == res[case]["planned"], (res[case]["plan"], res[case]["saved"])


def test_each_rank_holds_its_share(world: list[dict]) -> None:
    assert_element_counts([r["parity-gpt2-tp2-sp1"] for r in world], tp=2)


def test_latent_attention_splits_heads_and_replicates_down_projections(world: list[dict]) -> None:
    """MLA at tp=2: q_b_proj / kv_b_proj by heads, o_proj by its input columns, the down-projections whole on both
    ranks (two replicas: their gradients were summed over tp), the latent norms replicated."""
    for res in world:
        numel = res["parity-mla-tp2-sp1"]["numel"]
        for name in ("q_a_proj", "kv_a_proj"):
            local, full, dim, replicas = numel[f"layers.0.attn.{name}.weight"]
            assert local == full and dim == 0 and replicas == 2, name
        for name, dim in (("q_b_proj", 0), ("kv_b_proj", 0), ("o_proj", 1)):
            local, full, got, replicas = numel[f"layers.0.attn.{name}.weight"]
            assert 2 * local == full and got == dim and replicas == 1, name
        for name in ("q_a_norm", "kv_a_norm"):
            local, full, dim, _ = numel[f"layers.0.attn.{name}.weight"]
            assert local == full and dim is None, name


def test_region_autograd_and_vocab_ce(world: list[dict]) -> None:
    for res in world:
        assert_regions(res["regions"])
        assert_vocab_ce(res["vocab_ce"])
    assert_collectives([r["collectives"] for r in world], tp=2)


def test_cached_decoding_matches(world: list[dict]) -> None:
    for res in world:
        assert max(res["decode"].values()) < 1e-4, res["decode"]


def test_sequence_parallel_linears_match_and_overlap(world: list[dict]) -> None:
    for res in world:
        assert_gathered_linears(res["gathered_linears"])


def test_bf16_halves_the_tp_groups_activation_traffic(world: list[dict]) -> None:
    """Per step, the sequence-parallel all-gathers and reduce-scatters of the tp group move half the bytes
    under bf16 autocast that they move in fp32; the gradient all-reduces (fp32 gradients) do not change."""
    for res in world:
        for arch in ("llama", "gpt2"):
            fp32, bf16 = res["step_bytes"][(arch, "fp32")], res["step_bytes"][(arch, "bf16")]
            for op in ("all_gather", "reduce_scatter"):
                assert bf16[op] * 2 == fp32[op], (arch, op, fp32, bf16)
            assert sum(bf16.values()) <= 0.55 * sum(fp32.values()), (arch, fp32, bf16)


def test_async_tp_replaces_the_region_collectives_by_ring_steps(world: list[dict]) -> None:
    for res in world:  # (parity of the async cases is checked above)
        assert_ring_steps(res["parity-qwen3-tp2-sp1"]["tp_ops"], res["parity-qwen3-tp2-sp1-async"]["tp_ops"])


@pytest.mark.parametrize("case", ["pipeline-llava-pp2-1f1b", "pipeline-llava-pp2-zb"])
def test_llava_pipeline_with_the_encoder_on_the_first_stage(world: list[dict], case: str) -> None:
    held: set[str] = set()
    for rank, res in enumerate(world):
        r = res[case]
        for loss, ref in zip(r["loss"], r["loss_ref"], strict=True):
            assert abs(loss - ref) <= 1e-5 * abs(ref), (rank, r["loss"], r["loss_ref"])
        for norm, ref in zip(r["norm"], r["norm_ref"], strict=True):
            assert abs(norm - ref) <= 1e-5 * ref, (rank, r["norm"], r["norm_ref"])
        bad = {n: e for n, e in r["grad_err"].items() if not e[1]}
        assert not bad, bad
        ev, ref_ev = r["eval"]
        assert abs(ev - ref_ev) <= 1e-5 * ref_ev
        assert r["first_stage_has_vision"] == (rank == 0)
        assert any(n.startswith("vision.") for n in r["names"]) == (rank == 0)  # the encoder lives on stage 0 only
        held |= set(r["names"])
    assert any(n.startswith("projector.") for n in held) and "norm.weight" in held


def test_llava_pipeline_projector_only_stage(world: list[dict]) -> None:
    for rank, res in enumerate(world):
        r = res["pipeline-llava-pp2-frozen"]
        for loss, ref in zip(r["loss"], r["loss_ref"], strict=True):
            assert abs(loss - ref) <= 1e-5 * abs(ref), (rank, r["loss"], r["loss_ref"])
        assert not r["frozen_grads"] and r["bucketed"] == r["trainable"] == r["changed"]
        assert all(n.startswith("projector.") for n in r["trainable"]) and bool(r["trainable"]) == (rank == 0)


def test_groups_are_made_the_way_the_world_allows(world: list[dict]) -> None:
    """The harness starts the world as production does (runtime.start_process_group): NCCL with a device bound
    splits communicators; gloo on CPU cannot bind one (torch refuses device_id=cpu) and makes new groups, and
    torch refuses the split there, as the predicate says."""
    nccl = torch.cuda.device_count() >= 2
    for res in world:
        g = res["group_paths"]
        assert g["calls"] == sum(g["paths"].values()) == 2  # tp, and the one-rank kinds together
        if nccl:
            assert g["can_split"] and g["paths"] == {"split": 2}, g
        else:
            assert not g["can_split"] and g["paths"] == {"new_group": 2} and g["bound"] == "None", g
            assert "not safe to split" in g["refused"], g
