"""Parameter all-gathers in the compute dtype (dp=2, gloo, training in bf16): ZeRO-1/2 gather bf16 (fp32 master
shards kept apart) and FSDP2 (ZeRO-3) runs with MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32). The
bytes per step on the data-parallel group: the parameter all-gather halves against fp32 gathers, the gradient
reduce-scatter stays fp32 (the same bytes)."""

from __future__ import annotations

import pytest

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
