"""Parameter all-gathers in the compute dtype (dp=2, gloo, training in bf16): ZeRO-1/2 gather bf16 (fp32 master
shards kept apart) and FSDP2 (ZeRO-3) runs with MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32). The
bytes per step on the data-parallel group: the parameter all-gather halves against fp32 gathers, the gradient
reduce-scatter stays fp32 (the same bytes)."""

from __future__ import annotations

import pytest
import torch

from ..harness import run_world
from .mixed_worlds import suite_gather_dtype_world2


@pytest.fixture(scope="module")
def world() -> list[dict]:
    return run_world(2, suite_gather_dtype_world2)


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_bf16_parameter_gathers_move_half_the_bytes(world: list[dict], zero: int) -> None:
    for rank, res in enumerate(world):
        f32, b16 = res[f"z{zero}-float32"], res[f"z{zero}-bfloat16"]
        assert f32["gather"] > 0 and b16["gather"] * 2 == f32["gather"], (rank, f32["gather"], b16["gather"])
        assert b16["reduce"] == f32["reduce"] > 0, (rank, f32["reduce"], b16["reduce"])  # fp32 gradients
        assert b16["master"] == f32["master"] == "torch.float32"  # the optimizer's shard stays fp32
        for a, b in zip(b16["loss"], f32["loss"], strict=True):  # both bf16 training: close, not equal
            assert abs(a - b) <= 2e-2 * abs(b), (rank, a, b)


def test_fsdp2_computes_with_bf16_parameters(world: list[dict]) -> None:
    for res in world:
        assert res["z3-bfloat16"]["compute_dtype"] == "torch.bfloat16"
        assert res["z3-float32"]["compute_dtype"] == "torch.float32"


@pytest.mark.parametrize("zero", [1, 2])
def test_bf16_parameters_keep_fp32_only_in_the_master_shards(world: list[dict], zero: int) -> None:
    """train.bf16_params: the weights themselves in bf16 (half their bytes; the matmuls read them without a
    cast), the optimizer's fp32 masters made from the build's fp32 values (equal to the fp32-parameter run's, not
    rounded), the replicas the masters rounded after every step, the gathers the bf16 ones' bytes; the losses
    those of the same bf16 training with fp32 parameters within bf16 noise (norm weights and their gradients are
    bf16 now, Megatron's numerics)."""
    for rank, res in enumerate(world):
        low, ref = res[f"z{zero}-bf16-params"], res[f"z{zero}-bfloat16"]
        assert low["compute_dtype"] == "torch.bfloat16" and low["master"] == "torch.float32"
        assert low["param_bytes"] * 2 == ref["param_bytes"], (low["param_bytes"], ref["param_bytes"])
        assert all(a.dtype == b.dtype == torch.float32 and torch.equal(a, b)
                   for a, b in zip(low["masters0"], ref["masters0"], strict=True))
        assert low["rounded"] and ref["rounded"] and not low["master_init_left"]
        assert low["gather"] == ref["gather"] and low["reduce"] == ref["reduce"]
        for a, b in zip(low["loss"], ref["loss"], strict=True):
            assert abs(a - b) <= 2e-2 * abs(b), (rank, a, b)


def test_bf16_parameters_fuse_their_weight_gradients(world: list[dict]) -> None:
    """train.bf16_params with train.grad_accum_fusion: the bf16 weights of the blocks' linears add their gradients
    into the fp32 buckets in the GEMM too (they were left out, and their bf16 gradients took the bucket hook's
    add: the H100 70B rank's elementwise time went up by 36 ms). On CPU the fused path computes the same bf16
    product and adds it into the same fp32 bucket as the hook did: the same losses and masters, bit for bit."""
    for res in world:
        fused, plain = res["z1-bf16-params-fused"], res["z1-bf16-params"]
        assert fused["fused"] == 7 * 2 and plain["fused"] == 0, (fused["fused"], plain["fused"])
        assert fused["loss"] == plain["loss"], (fused["loss"], plain["loss"])
        assert all(torch.equal(a, b) for a, b in zip(fused["masters"], plain["masters"], strict=True))


def test_an_untied_token_embedding_fuses_its_weight_gradient_too(world: list[dict]) -> None:
    """The token embedding's weight gradient added into its fp32 main gradient by grad_fusion.accumulate_rows (the
    70B rank's dense [V/tp, d] gradient, its zero-fill and its add: ~15 ms a step on the H100). On CPU the op computes
    the dense gradient and adds it, as autograd and the bucket hook did: the same training bit for bit, with one more
    fused weight (the head's copy stays on the hook's path)."""
    for res in world:
        fused, plain = res["z1-bf16-params-untied-True"], res["z1-bf16-params-untied-False"]
        assert fused["fused"] == 7 * 2 + 1 and plain["fused"] == 0, (fused["fused"], plain["fused"])
        assert fused["loss"] == plain["loss"], (fused["loss"], plain["loss"])
        assert all(torch.equal(a, b) for a, b in zip(fused["masters"], plain["masters"], strict=True))
        assert fused["loss"] != res["z1-bf16-params-fused"]["loss"]  # (untied: another model, not the same run)


def test_bf16_parameters_at_zero_0_keep_every_master_and_train_as_zero_1(world: list[dict]) -> None:
    """train.bf16_params at parallel.zero=0: the weights bf16, the optimizer's fp32 masters every parameter whole
    (Megatron's non-distributed optimizer: 6 bytes a weight, no casts), the buckets all-reduced and nothing
    gathered. The same training as ZeRO-1's bf16 parameters (fused there, not here), bit for bit: the losses, the
    bf16 weights every replica holds; its masters the whole model, ZeRO-1's half of it."""
    for res in world:
        z0, z1 = res["z0-bf16-params-noclip"], res["z1-bf16-params-noclip"]
        assert z0["compute_dtype"] == "torch.bfloat16" and z0["master"] == "torch.float32"
        assert z0["gather"] == 0 and z0["reduce"] == 0 and z1["gather"] > 0  # zero 0: one all-reduce, no gather
        assert z0["shard_numel"] == sum(w.numel() for w in z0["weights"]) and z0["rounded"]
        assert z1["shard_numel"] * 2 >= z0["shard_numel"] > z1["shard_numel"]
        assert z0["loss"] == z1["loss"], (z0["loss"], z1["loss"])
        assert all(a.dtype == torch.bfloat16 and torch.equal(a, b)
                   for a, b in zip(z0["weights"], z1["weights"], strict=True))
