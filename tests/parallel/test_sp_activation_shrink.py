"""Activations that shrink with tensor parallelism: with sequence parallelism a block's saved bytes at tp=t are
within 1.15x of tp=1's / t (Korthikanti et al. 2022), measured by saved-tensor hooks, and as the memory plan says.

Only bytes matter here, so each tp degree runs as rank 0 of torch's fake process group (collectives return at
once, values are not exchanged) in this process: worlds of 2, 4 and 8 cost no spawned processes. Numerical
parity of the same path is checked in real gloo worlds (test_world2.py, test_world4.py).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

from megaloom.config import load_config
from megaloom.models import Transformer, apply_recompute
from megaloom.observe.saved_tensors import measured_block_activation_bytes
from megaloom.parallel.mesh import Mesh
from megaloom.parallel.tensor import parallelize_tensor
from megaloom.planning.memory_activations import block_activation_bytes

B, T = 2, 64
DEGREES = (1, 2, 4, 8)
CASES = [(arch, precision) for arch in ("gpt2", "llama") for precision in ("bf16", "fp32")]


def _cfg(arch: str, precision: str, tp: int):
    # Multi-head attention (8 KV heads) as GPT-3: no KV head is replicated up to tp=8.
    return load_config(None, [
        f"model.arch={arch}", "model.vocab_size=256", "model.d_model=128", "model.n_layers=1", "model.n_heads=8",
        "model.n_kv_heads=8", "model.ffn_dim=512", f"model.max_seq_len={T}", f"train.seq_len={T}",
        f"train.micro_batch_size={B}", f"train.global_batch_size={B}", f"parallel.tp={tp}", "parallel.sp=true",
        f"train.precision={precision}", "train.recompute=selective"])


@contextlib.contextmanager
def _fake_world(tp: int):
    if tp == 1:
        yield
        return
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _block_bytes(arch: str, precision: str, tp: int) -> int:
    cfg = _cfg(arch, precision, tp)
    torch.manual_seed(0)
    with _fake_world(tp):
        mesh = Mesh.build(cfg, tp, 0, "cpu")
        model = parallelize_tensor(Transformer(cfg.model), mesh, sp=True)
        apply_recompute(model, "selective", core_attention=False)  # as the trainer with the CPU flash kernel
        x = torch.randn(B, T // tp, cfg.model.d_model)  # this rank's sequence shard of the residual stream
        auto = torch.bfloat16 if precision == "bf16" else None
        return measured_block_activation_bytes(model.layers["0"], x, model.rope(T), autocast=auto)


@pytest.fixture(scope="module")
def measured() -> dict[tuple[str, str], dict[int, int]]:
    return {case: {tp: _block_bytes(*case, tp) for tp in DEGREES} for case in CASES}


@pytest.mark.parametrize("case", CASES)
def test_block_activations_shrink_with_tp(measured, case):
    per_tp = measured[case]
    for tp in DEGREES[1:]:
        assert per_tp[tp] <= 1.15 * per_tp[1] / tp, (case, per_tp)


@pytest.mark.parametrize("case", CASES)
def test_memory_plan_predicts_the_measured_bytes(measured, case):
    for tp, got in measured[case].items():
        plan = block_activation_bytes(_cfg(*case, tp), tokens=B * T, batch=B, tp=tp, sp=True, device="cpu")
        assert sum(plan.values()) == got, (case, tp, plan)
