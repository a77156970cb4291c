"""The memory plan, parameter counts and FLOP counter know multi-head latent attention (model.attention=mla):
saved bytes of whole models (2 and 4 blocks, per block and in total) equal what autograd saves on CPU, the
analytic parameter counts equal the module's, and the attention FLOPs follow MLA's head sizes."""

from __future__ import annotations

import pytest
import torch

from megaloom.config import load_config
from megaloom.models import Transformer
from megaloom.observe.flops import flops_per_token, matmul_params
from megaloom.planning.memory_params import analytic_params, count_model_params
from megaloom.planning.memory_plan import plan_memory

from .test_memory_plan import check

# the latent norms under bf16 autocast: bf16 latents, fp32 weights, so PyTorch warns it takes the composite (planned)
pytestmark = pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight:UserWarning")
# v (12) narrower than q/k (16 + 8): the core pads v, and o_proj reads a sliced copy
MLA = ["model.attention=mla", "model.n_kv_heads=0", "model.kv_lora_rank=24", "model.qk_nope_head_dim=16",
       "model.qk_rope_head_dim=8", "model.v_head_dim=12"]
QLORA = ["model.q_lora_rank=20"]
MOE = ["model.moe_every=1", "model.first_dense_layers=1", "model.n_experts=4", "model.top_k=2",
       "model.expert_ffn_dim=48", "model.n_shared_experts=1", "model.router_score=sigmoid",
       "model.n_expert_groups=2", "model.topk_groups=1", "model.routed_scaling_factor=2.5"]


@pytest.mark.parametrize("precision,recompute,q", [("fp32", "none", []), ("bf16", "none", QLORA),
                                                    ("bf16", "selective", []), ("fp32", "full", QLORA)])
def test_mla_blocks_saved_bytes_are_exact(precision, recompute, q):
    check("llama", precision, recompute, *MLA, *q)


@pytest.mark.parametrize("case", [
    ("fp32", "none", "model.dropout=0.1"),  # CPU: dropout sends SDPA to the math backend
    ("bf16", "none", "model.sliding_window=16"),
    ("fp32", "none", "model.v_head_dim=24"),  # v as wide as q/k: no padding, o_proj reads a view
    ("bf16", "none", *QLORA, *MOE),  # DeepSeek-V3's block: the first dense, then MoE with group-limited routing
])
def test_mla_variants_saved_bytes_are_exact(case):
    check("llama", case[0], case[1], *MLA, *case[2:])


def _model(*extra: str):
    cfg = load_config(None, ["model.preset=tiny", "model.vocab_size=256", "model.d_model=64", *MLA, *extra])
    with torch.device("meta"):
        return cfg, Transformer(cfg.model)


@pytest.mark.parametrize("extra", [[], QLORA, [*QLORA, *MOE, "model.tie_embeddings=false"]])
def test_analytic_parameter_counts_match_the_module(extra):
    cfg, model = _model(*extra)
    exact, guess = count_model_params(model), analytic_params(cfg, list(range(cfg.model.n_layers)))
    assert (guess.local, guess.block_params, guess.matmul_layers, guess.matmul_head) == (
        exact.local, exact.block_params, exact.matmul_layers, exact.matmul_head)


def test_deepseek_v3_preset_counts_and_plans():
    cfg = load_config(None, ["model.preset=deepseek-v3", "train.seq_len=4096", "train.micro_batch_size=1",
                             "train.global_batch_size=1", "train.precision=bf16"])
    guess = analytic_params(cfg, list(range(cfg.model.n_layers)))
    assert guess.local == 671_026_404_352  # the module's count (tests/models/test_mla.py)
    plan = plan_memory(cfg, device="cuda")
    assert plan.weights == 4 * guess.local and plan.peak > plan.weights


def test_attention_flops_follow_mla_head_sizes():
    cfg, model = _model(*QLORA)
    m, n = cfg.model, matmul_params(model)
    # scores over 16 + 8 and values over 12 per head, forward and backward: 6 x L x H x (24 + 12) x seq
    assert flops_per_token(m, n, 128) == 6 * n + 6 * m.n_layers * m.n_heads * (24 + 12) * 128
    projections = sum(p.numel() for name, p in model.named_parameters()
                      if name.startswith("layers.0.attn.") and p.ndim == 2)
    assert projections == 64 * 20 + 20 * 4 * 24 + 64 * (24 + 8) + 24 * 4 * (16 + 12) + 4 * 12 * 64  # per block
    gqa = load_config(None, ["model.preset=tiny", "model.vocab_size=256"])
    assert flops_per_token(gqa.model, 0, 128) == 12 * gqa.model.n_layers * gqa.model.d_model * 128  # unchanged
