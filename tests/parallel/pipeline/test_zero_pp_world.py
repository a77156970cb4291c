"""ZeRO with pipelines in one world of 4 processes (pp2 x dp2; gloo on CPU), started once.

Per layout (ZeRO 0/1/2 x 1F1B, GPipe, ZB-H1 and interleaved vpp=2; tied and untied embeddings; AdamW and LAMB;
llama and gpt2; an MoE model with ep=2 over the data-parallel ranks): every step's global-batch loss and gradient
norm (clipped: the norm exceeds the limit) within 1e-5 of the single process, the weights after 4 steps within
float32 noise, and the buckets: each reduced once per step, all of them issued while backward still ran (per
chunk), no collective on the data-parallel group bigger than one bucket (no flat whole-model buffer), the tied
embedding's bucket summed over the first and last stage with 1/dp of its bytes. A checkpoint written at
pp2 x vpp2 x dp2 ZeRO-1 resumes at pp2 ZeRO-2 (other buckets), pp2 ZeRO-0, pp1 x dp4 ZeRO-1 and in one
process with the reference's next losses. Parameter all-gathers in bf16 move half the bytes of fp32 on the
data-parallel group, with fp32 master shards, and are issued before the next forward's first computation. 1-bit
Adam / LAMB compress only the data-parallel buckets and keep the replicas and the tied copies equal.
"""

from __future__ import annotations

import copy
import types

import pytest
import torch

from megaloom.checkpoint.store import load_checkpoint
from megaloom.step import TrainStep

from ..harness import run_world
from .zero_pp_worlds import CLIP, MICRO, batches, config, optimizer, reference, suite_zero_pp_world4

PARITY = ["pp2dp2-1f1b-z0", "pp2dp2-1f1b-z1", "pp2dp2-1f1b-z2", "pp2dp2-zb-z1", "pp2dp2-zb-z2", "pp2dp2-gpipe-z2",
          "pp2dp2-vpp2-z1", "pp2dp2-vpp2-z2", "pp2dp2-1f1b-z1-untied", "pp2dp2-1f1b-z1-lamb", "pp2dp2-1f1b-z2-gpt2",
          "pp2dp2ep2-moe-z0", "pp2dp2ep2-moe-z1", "pp2dp2ep2-moe-z2", "pp2dp2ep2-moe-vpp2-z1", "pp2dp2-1f1b-z1-lora"]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("zero-pp"))


@pytest.fixture(scope="module")
def world(root: str) -> list[dict]:
    return run_world(4, suite_zero_pp_world4, root, timeout=600.0)


def assert_parity(world: list[dict], case: str) -> None:
    for rank, res in enumerate(world):
        r = res[case]
        for step, (got, want) in enumerate(zip(r["loss"], r["loss_ref"], strict=True)):
            assert abs(got - want) <= 1e-5 * abs(want), f"rank {rank} step {step}: loss {got} vs {want}"
        for step, (got, want) in enumerate(zip(r["norm"], r["norm_ref"], strict=True)):
            assert want > r["clip"] and abs(got - want) <= 1e-5 * want, f"rank {rank} step {step}: norm {got} vs {want}"
        assert r["param_err"] < 2e-5, (rank, r["param_err"])  # seen <= 2e-6 after 4 steps
        assert r["base_changed"] == [], (rank, r["base_changed"])  # LoRA: the frozen base untouched


@pytest.mark.parametrize("case", PARITY)
def test_zero_with_pipeline_matches_single_process(world: list[dict], case: str) -> None:
    assert_parity(world, case)


@pytest.mark.parametrize("case", PARITY)
def test_buckets_reduce_in_backward_and_never_the_whole_model(world: list[dict], case: str) -> None:
    zero = int(next(part for part in case.split("-") if part[0] == "z" and part[1:].isdigit())[1:])
    steps = len(world[0][case]["loss"])
    for res in world:
        r = res[case]
        st = r["stats"]
        assert st["per_step"] == [[1] * r["n_buckets"]] * steps  # each bucket reduced exactly once per step
        # Issued as their chunks finished, not after the pipeline; every bucket's parameters got gradients.
        assert st["in_backward"] == [r["n_buckets"]] * steps and st["in_finish"] == [0] * steps
        assert st["issued_unarmed"] == 0
        dp_ops = [(name, n) for name, g, n in r["events"] if g in ("dp", "edp") and not name.startswith("wait")]
        reduce = "all_reduce_sum_async" if zero == 0 else "reduce_scatter_async"
        issued = [n for name, n in dp_ops if name == reduce]
        # Expert buckets reduce over edp, a single rank at dp2 x ep2: nothing to send for those.
        shared = sum(size > 1 for size in r["bucket_ranks"])
        assert shared and len(issued) == shared * steps
        # No flat buffer of the whole stage: the largest collective on dp is one bucket.
        assert max(n for _, n in dp_ops) <= max(r["bucket_bytes"]) < r["model_bytes"]
        if zero:
            gathers = [n for name, n in dp_ops if name == "all_gather_async"]
            assert len(gathers) == shared * steps
            # 1/(its group's size) of every bucket
            assert r["shard_numel"] == sum(b // 4 // k for b, k in zip(r["bucket_bytes"], r["bucket_ranks"],
                                                                        strict=True))
        tied = [n for name, g, n in r["events"] if g == "emb" and not name.startswith("wait")]
        if "untied" in case or not any(r["tied_bucket"]):
            assert tied == []
        else:  # one sum per step over {first, last stage}: the whole bucket (zero 0) or this rank's half of it
            bucket = r["bucket_bytes"][r["tied_bucket"].index(True)]
            assert tied == [bucket // (1 if zero == 0 else 2)] * steps


def test_tied_copies_and_every_stage_present(world: list[dict]) -> None:
    """The first stage holds the embedding's bucket first-in-model (issued last), the last stage its copy's
    bucket first-in-backward; the middle of the model is on neither (pp = 2: every rank holds one)."""
    for rank, res in enumerate(world):
        tied = res["pp2dp2-1f1b-z1"]["tied_bucket"]
        assert sum(tied) == 1
        assert tied.index(True) == (len(tied) - 1 if rank < 2 else 0)  # ranks 0, 1: stage 0 (mesh order)


def test_checkpoint_moves_between_zero_pipeline_layouts(world: list[dict], root: str) -> None:
    want = world[0]["ckpt"]["ref"]
    for rank, res in enumerate(world):
        for layout in ("pp2-z2", "pp2-z0", "dp4-z1"):
            got = res["ckpt"][layout]
            for step, (g, w) in enumerate(zip(got, want, strict=True)):
                assert abs(g - w) <= 1e-5 * w, (rank, layout, step, g, w)
    # One process reads the same files (layout-free) and continues the same way.
    cfg = config(2, vpp=2, world=4)
    data = batches(types.SimpleNamespace(dp=2, device=torch.device("cpu")), 4, 5)
    ref = reference(cfg, "adamw", data, torch.device("cpu"), {})
    model = copy.deepcopy(ref["base"])
    opt = optimizer(model, None, 0, "adamw", None)
    load_checkpoint(_ckpt(root), model, opt)
    step = TrainStep(model, opt, "fp32", torch.device("cpu"), MICRO, CLIP)
    for b, w in zip(data[3:], want, strict=True):
        got = step(b).loss.item()
        assert abs(got - w) <= 1e-5 * w, (got, w)


def _ckpt(root: str):
    from pathlib import Path

    (path,) = [p for p in (Path(root) / "ckpt").iterdir() if p.name.startswith("step_")]
    return path


def _bytes(rows: list[dict], group: str, op: str) -> int:
    return sum(r["bytes"] for r in rows if r["group"] == group and r["op"] == op)


def test_bf16_parameter_gathers_halve_the_bytes(world: list[dict]) -> None:
    """The recorder's bytes per step on the data-parallel group: the parameter all-gather in bf16 is half of
    fp32's; the gradient reduce-scatter (fp32 main grads) is unchanged; the masters stay fp32."""
    for rank, res in enumerate(world):
        f32, b16 = res["gather-fp32"], res["gather-bf16"]
        g32, g16 = _bytes(f32["rows"], "dp", "all_gather"), _bytes(b16["rows"], "dp", "all_gather")
        assert g32 == 4 * f32["numel"] * 2 and g16 * 2 == g32, (rank, g32, g16)  # two steps counted
        assert _bytes(f32["rows"], "dp", "reduce_scatter") == _bytes(b16["rows"], "dp", "reduce_scatter") > 0
        assert b16["separate"] and not f32["separate"] and b16["master_dtype"] == "torch.float32"
        assert b16["param_dtype"] == "torch.float32"  # the model keeps fp32 storage; autocast rounds for matmuls
        # fp32 gathers are exact; bf16 replicas compute with rounded weights: close, not equal.
        for got, want in zip(f32["loss"], f32["loss_ref"], strict=True):
            assert abs(got - want) <= 1e-5 * want
        for got, want in zip(b16["loss"], b16["loss_ref"], strict=True):
            assert abs(got - want) <= 1e-2 * want


@pytest.mark.parametrize("case", ["gather-bf16", "gather-bf16-compiled"])
def test_parameter_gathers_are_issued_before_the_forward_they_precede(world: list[dict], case: str) -> None:
    """Overlap: every bucket's all-gather is issued (by the optimizer step) before the next step's first forward
    computation, and its wait comes later, from the forward pre-hook of the first module that needs it (with
    compiled blocks: the block's one hook, run before its graph)."""
    for rank, res in enumerate(world):
        order = res[case]["order"]
        n = res[case]["n_buckets"]
        # compiled blocks train as the eager ones do (the same arithmetic, weights waited for before each graph)
        assert res[case]["loss"] == pytest.approx(res["gather-bf16"]["loss"], rel=1e-5)
        assert res[case]["wait_breaks"] == 0  # one hook per compiled block, run before its graph, none inside
        issued = [i for i, e in enumerate(order) if e[:2] == ("comm", "all_gather_async") and e[2] == "dp"]
        assert len(issued) == 2 * n  # two steps counted
        # The gathers of the second step's optimizer step are issued together, before the third step's first
        # forward computation ...
        nxt = next(i for i, e in enumerate(order) if e[0] == "forward" and i > issued[0])
        assert issued[n - 1] < nxt, (rank, issued[:n], nxt)
        # ... and waited for inside that forward (by the pre-hooks of the modules that need them), not before it.
        waited = [i for i, e in enumerate(order) if e[:2] == ("comm", "wait all_gather") and e[2] == "dp"
                  and issued[n - 1] < i < issued[n]]
        assert len(waited) == n and max(waited) > nxt, (rank, waited, nxt)


ONEBIT = ["pp2dp2-onebit_adam", "pp2dp2-onebit_lamb", "pp2dp2ep2-moe-onebit_adam"]


@pytest.mark.parametrize("case", ONEBIT)
def test_onebit_compresses_only_the_data_parallel_buckets_under_pp_and_ep(world: list[dict], case: str) -> None:
    """1-bit Adam / LAMB through the pipeline executor (tied embedding across the stages) and with experts over
    ep: the warm-up steps equal plain AdamW's single process (AdamW's own step: the LAMB case is AdamW's loss only
    at its first step); after it the data-parallel group carries no bucket all-reduce, one all-to-all and one
    all-gather per bucket shared by several ranks (expert buckets of a one-rank edp group are exact, not sent); the
    dp replicas and the two copies of the tied embedding stay bitwise equal; the loss stays near AdamW's."""
    for res in world:
        r = res[case]
        warm, shared = r["warmup"], sum(size > 1 for size in r["bucket_ranks"])
        assert r["compressed"] == [size > 1 for size in r["bucket_ranks"]] and shared
        assert r["finite"] and r["replica_err"] == 0.0 and r["tied_err"] == 0.0, r
        for step, (got, want) in enumerate(zip(r["loss"], r["loss_ref"], strict=True)):
            if step <= (0 if "lamb" in case else warm):  # (a step's loss is taken before its update)
                assert abs(got - want) <= 1e-5 * want, (step, got, want)
            assert abs(got - want) <= 0.02 * want, (step, got, want)
        for step, ops in enumerate(r["ops"]):
            if step < warm:
                assert ops.count("all_reduce_sum_async") == shared and "all_to_all_async" not in ops, (step, ops)
            else:
                assert "all_reduce_sum_async" not in ops, (step, ops)
                assert ops.count("all_to_all_async") == ops.count("all_gather_async") == shared, (step, ops)
