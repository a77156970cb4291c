"""Does the memory plan know every model family? One block of each registered family, measured against the plan.

For each family in `megaloom.models.registry.FAMILIES` (a new family is covered by registering it) one Block
of a tiny model (d_model 64) runs a forward on CPU under saved-tensor hooks
(`megaloom.observe.saved_tensors.measured_block_activation_bytes`) and the bytes must equal
`block_activation_bytes(..., device="cpu")` exactly: fp32 (the check the issue asks for) and bf16 autocast, with
and without selective recomputation. The plan models CPU exactly (composite RMSNorm, the CPU flash kernel), so
no tolerance is needed; a failure means the family's block saves something the plan does not know (a new norm,
attention or MLP variant): teach `memory_plan.block_activation_bytes` its traits.

QK-norm (Traits.qk_norm) is also checked through a stand-in family built here, as Qwen3 / OLMo-2 do it, so the
plan's term is tested before (and independently of) a registered family that uses it.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from megaloom.config import ConfigError, load_config
from megaloom.models import llama
from megaloom.models.attention import Attention
from megaloom.models.family import Family
from megaloom.models.layers import rope_tables
from megaloom.models.registry import FAMILIES
from megaloom.models.transformer import Block, Transformer
from megaloom.observe.saved_tensors import SavedStorages, measured_block_activation_bytes
from megaloom.planning.memory_activations import block_activation_bytes
from megaloom.planning.memory_params import analytic_params, count_model_params

B, T, D = 2, 32, 64
# QK-norm under bf16 autocast: bf16 heads, fp32 norm weight, so PyTorch warns it takes the composite (as planned)
pytestmark = pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight:UserWarning")


class QKNormAttention(Attention):
    """Attention with an RMSNorm over each query and key head before RoPE (Qwen3, OLMo-2)."""

    def __init__(self, *args, norm_eps: float = 1e-5, **kwargs):
        super().__init__(*args, norm_eps=norm_eps, **kwargs)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=norm_eps)
        self.k_norm = nn.RMSNorm(self.head_dim, eps=norm_eps)

    def per_head_qk(self, q, k):
        return self.q_norm(q), self.k_norm(k)


QK_NORM = Family(name="qk-norm-stand-in", description="llama with QK-norm (test stand-in)",
                 traits=dataclasses.replace(llama.TRAITS, qk_norm=True, attention=QKNormAttention),
                 plan=llama.FAMILY.plan)
FAMILY_NAMES = [*FAMILIES, QK_NORM.name]


@pytest.fixture
def family(request, monkeypatch) -> Family:
    """The family named by the test's parameter; the stand-in is registered for the test's duration."""
    monkeypatch.setitem(FAMILIES, QK_NORM.name, QK_NORM)
    return FAMILIES[request.param]


def make_cfg(family: Family, precision: str, *extra: str):
    """A tiny config of ``family``, with grouped-query heads unless the family refuses them."""
    for kv in (2, 0):
        try:
            return load_config(None, [f"model.arch={family.name}", f"model.d_model={D}", "model.n_heads=4",
                                      f"model.n_kv_heads={kv}", "model.ffn_dim=128", "model.vocab_size=256",
                                      f"model.max_seq_len={T}", "model.n_layers=2", f"train.seq_len={T}",
                                      f"train.micro_batch_size={B}", f"train.global_batch_size={B}",
                                      f"train.precision={precision}", *extra])
        except ConfigError:
            if kv == 0:
                raise
    raise AssertionError("unreachable")


def block_and_inputs(cfg, family: Family, selective: bool):
    """Block 0 of ``cfg`` (recomputation flags set), an input [B, T, D] and the RoPE tables (None: learned)."""
    torch.manual_seed(0)
    block = Block(cfg.model, 0, family)
    block.mlp.recompute_activation = selective
    block.attn.recompute_core = False  # the CPU flash kernel: selective leaves the attention core (apply_recompute)
    rope = None
    if family.traits.positions == "rope":
        cos, sin = rope_tables(D // cfg.model.n_heads, T, cfg.model.rope_theta)
        rope = (cos[:T], sin[:T])
    return block, torch.randn(B, T, D), rope


def measure(cfg, family: Family, selective: bool) -> int:
    autocast = torch.bfloat16 if cfg.train.precision == "bf16" else None
    return measured_block_activation_bytes(*block_and_inputs(cfg, family, selective), autocast=autocast)


def planned(cfg, selective: bool) -> dict[str, int]:
    return block_activation_bytes(cfg, tokens=B * T, batch=B, device="cpu",
                                  recompute="selective" if selective else "none")


@pytest.mark.parametrize("selective", [False, True], ids=["none", "selective"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("family", FAMILY_NAMES, indirect=True)
def test_block_saved_bytes_match_the_plan(family, precision, selective):
    cfg = make_cfg(family, precision)
    plan = planned(cfg, selective)
    measured = measure(cfg, family, selective)
    assert measured == sum(plan.values()), (f"{family.name}: one block saves {measured} bytes, the plan says "
                                            f"{sum(plan.values())}: {plan}")


@pytest.mark.parametrize("family", FAMILY_NAMES, indirect=True)
def test_block_weight_casts_match_the_plan(family):
    """Under bf16 autocast the block's matmul weights (2-D: not its norms, QK-norm's included) are cast and saved
    once each: the plan's weight casts, 2 bytes x `analytic_params(...).matmul_layers`."""
    cfg = make_cfg(family, "bf16")
    block, x, rope = block_and_inputs(cfg, family, False)
    with SavedStorages([*block.parameters(), *(rope or ())]) as saved, torch.autocast("cpu", dtype=torch.bfloat16):
        out = block(x.requires_grad_() * 1.0, rope)  # not a leaf, as in training (see measured_block_activation_bytes)
    del out
    assert saved.weight_casts == 2 * analytic_params(cfg, [0]).matmul_layers[0]


@pytest.mark.parametrize("family", FAMILY_NAMES, indirect=True)
def test_qkv_bias_saves_nothing_more_and_is_counted(family):
    """model.qkv_bias adds parameters (q/k/v biases) but no saved activations (addmm keeps input and weight)."""
    cfg = make_cfg(family, "fp32", "model.qkv_bias=true")
    assert measure(cfg, family, False) == sum(planned(cfg, False).values())
    with torch.device("meta"):
        model = Transformer(cfg.model, family)
    exact, guess = count_model_params(model), analytic_params(cfg, [0, 1])
    assert (guess.local, guess.block_params, guess.matmul_layers) == (exact.local, exact.block_params,
                                                                      exact.matmul_layers)


@pytest.mark.parametrize("family", FAMILY_NAMES, indirect=True)
def test_analytic_parameter_counts_know_the_family(family):
    cfg = make_cfg(family, "fp32", "model.tie_embeddings=false")
    with torch.device("meta"):
        model = Transformer(cfg.model, family)
    exact, guess = count_model_params(model), analytic_params(cfg, [0, 1])
    assert guess.local == exact.local
    assert guess.block_params == exact.block_params
    assert guess.matmul_layers == exact.matmul_layers
    assert guess.matmul_head == exact.matmul_head


def test_qk_norm_is_planned(monkeypatch):
    """The stand-in's two per-head norms are what separates it from llama in the plan (and nothing else)."""
    monkeypatch.setitem(FAMILIES, QK_NORM.name, QK_NORM)
    with_norm = planned(make_cfg(QK_NORM, "fp32"), False)
    without = planned(make_cfg(FAMILIES["llama"], "fp32"), False)
    assert set(with_norm) - set(without) == {"q/k norms"}
    assert {k: v for k, v in with_norm.items() if k != "q/k norms"} == without
