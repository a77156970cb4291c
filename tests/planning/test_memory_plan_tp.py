"""The memory plan's activation model under tensor (and sequence) parallelism: two gloo ranks on CPU.

Each rank runs one forward of its tensor-parallel shard of a tiny model under saved-tensor hooks (as in
test_memory_plan.py) and the bytes are compared with `block_activation_bytes(tp=2, sp=...)` and the
vocabulary-parallel embedding and loss.
"""

from __future__ import annotations

import pytest
import torch

from megaloom.config import load_config
from megaloom.planning.memory_activations import (
    block_activation_bytes,
    embedding_activation_bytes,
    head_activation_bytes,
)
from megaloom.planning.memory_params import analytic_params

# the latent norms under bf16 autocast warn that they take the composite (as planned)
pytestmark = pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight:UserWarning")
CASES = [(arch, precision, sp, recompute) for arch in ("llama", "gpt2") for precision in ("fp32", "bf16")
         for sp in (False, True) for recompute in ("none", "selective")]
# latent attention (llama with model.attention=mla, query compression): replicated down-projections, heads split
CASES += [("mla", precision, sp, "none") for precision in ("fp32", "bf16") for sp in (False, True)]
B, T, VOCAB = 2, 32, 256
MLA = ["model.attention=mla", "model.q_lora_rank=20", "model.kv_lora_rank=24", "model.qk_nope_head_dim=16",
       "model.qk_rope_head_dim=8", "model.v_head_dim=12"]


def _cfg(arch: str, precision: str, sp: bool, recompute: str, n_layers: int):
    mla = arch == "mla"
    return load_config(None, [
        f"model.arch={'llama' if mla else arch}", f"model.vocab_size={VOCAB}", "model.d_model=64",
        f"model.n_layers={n_layers}", "model.n_heads=4",
        f"model.n_kv_heads={2 if arch == 'llama' else 4}", "model.ffn_dim=128", *(MLA if mla else []),
        f"model.max_seq_len={T}", f"train.seq_len={T}", f"train.micro_batch_size={B}", f"train.global_batch_size={B}",
        "parallel.tp=2", f"parallel.sp={sp}", f"train.precision={precision}", f"train.recompute={recompute}"])


def _measure(mesh, cfg) -> tuple[int, int]:
    from megaloom.models import Transformer, apply_recompute
    from megaloom.parallel.tensor import parallelize_tensor

    from .test_memory_plan import saved_bytes

    torch.manual_seed(0)
    model = parallelize_tensor(Transformer(cfg.model), mesh, cfg.parallel.sp)
    apply_recompute(model, cfg.train.recompute, core_attention=False)  # as the trainer with the CPU flash kernel
    gen = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, VOCAB, (B, T), generator=gen) for _ in range(2))
    return saved_bytes(model, x, y, cfg.train.precision)


def rank_suite(rank: int, world: int, device: torch.device) -> dict:
    from megaloom.parallel.mesh import Mesh

    mesh = Mesh.build(_cfg("llama", "fp32", False, "none", 2), world, rank, device)
    return {case: [_measure(mesh, _cfg(*case, n)) for n in (2, 4)] for case in CASES}


@pytest.fixture(scope="module")
def world() -> list[dict]:
    harness = pytest.importorskip("parallel.harness", reason="tests/parallel's world harness")
    return harness.run_world(2, rank_suite)


@pytest.mark.parametrize("case", CASES)
def test_tensor_parallel_saved_bytes_are_exact(world, case):
    n = B * T
    for res in world:
        (m2, c2), (m4, c4) = res[case]
        cfg = _cfg(*case, 2)
        block = sum(block_activation_bytes(cfg, tokens=n, batch=B, tp=2, sp=case[2], device="cpu").values())
        assert (m4 - m2) // 2 == block
        total = (sum(embedding_activation_bytes(cfg, tokens=n, batch=B, tp=2, device="cpu").values()) + 2 * block
                 + sum(head_activation_bytes(cfg, tokens=n, tp=2, sp=case[2], device="cpu").values()))
        assert m2 == total
        counts = analytic_params(cfg, [0, 1], tp=2)
        casts = 2 * (counts.matmul_head + sum(counts.matmul_layers.values())) if case[1] == "bf16" else 0
        assert c2 == casts
