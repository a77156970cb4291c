"""Multi-head latent attention (model.attention=mla, megaloom/models/mla.py) on one process: its parameters, the
latent decoding cache against the full forward, DeepSeek's softmax scale, recomputation, the DeepSeek-V3 router
(group-limited top-k, scaled weights), dense first blocks, and the config's refusals."""

from __future__ import annotations

import math

import pytest
import torch

from megaloom.config import ConfigError, load_config
from megaloom.models.attention_shapes import attention_projections, rope_dim
from megaloom.models.mla import LatentCache, MLAttention, mla_softmax_scale
from megaloom.models.moe import MoE, Router
from megaloom.models.registry import get_family
from megaloom.models.transformer import apply_recompute

MLA = ["model.attention=mla", "model.n_kv_heads=0", "model.kv_lora_rank=24", "model.qk_nope_head_dim=16",
       "model.qk_rope_head_dim=8", "model.v_head_dim=12"]


def mla_config(*extra: str):
    return load_config(None, ["model.preset=tiny", "model.vocab_size=128", "model.d_model=64", "model.n_layers=2",
                              "model.max_seq_len=32", "train.seq_len=32", *MLA, *extra])


def build(*extra: str):
    cfg = mla_config(*extra)
    torch.manual_seed(0)
    return cfg, get_family(cfg.model.arch).build(cfg.model)


@pytest.mark.parametrize("q_lora", [0, 20])
def test_projections_are_the_config_shapes(q_lora):
    cfg, model = build(f"model.q_lora_rank={q_lora}")
    attn = model.layers["0"].attn
    assert isinstance(attn, MLAttention)
    got = {n: tuple(p.shape) for n, p in attn.named_parameters()}
    want = {f"{p.name}.weight": (p.out, p.inp) for p in attention_projections(cfg.model)}
    want["kv_a_norm.weight"] = (24,)
    if q_lora:
        want["q_a_norm.weight"] = (q_lora,)
    assert got == want
    assert model.rope_cos.shape == (32, rope_dim(cfg.model)) == (32, 8)


@pytest.mark.parametrize("q_lora", [0, 20])
def test_latent_cache_decodes_like_the_full_forward(q_lora):
    _, model = build(f"model.q_lora_rank={q_lora}")
    model.eval()
    x = torch.randint(0, 128, (2, 14), generator=torch.Generator().manual_seed(1))
    caches = model.new_caches(2, 32)
    assert isinstance(caches[0], LatentCache) and caches[0].latent.shape == (2, 32, 24)
    assert caches[0].k_rope.shape == (2, 32, 1, 8)  # one rotated key part per token, shared by the 4 heads
    with torch.no_grad():
        full = model(x)
        parts = [model(x[:, :9], caches=caches, pos=0)]
        parts += [model(x[:, i:i + 1], caches=caches, pos=i) for i in range(9, 14)]
    assert (torch.cat(parts, 1) - full).abs().max().item() < 1e-5


def test_generation_with_the_latent_cache_equals_rerunning_the_prefix():
    from megaloom.generate import generate

    _, model = build("model.q_lora_rank=20")
    prompt = torch.randint(0, 128, (2, 5), generator=torch.Generator().manual_seed(4))
    cached = generate(model, prompt, 10, temperature=0.8, top_k=20, seed=3)
    assert torch.equal(cached, generate(model, prompt, 10, temperature=0.8, top_k=20, seed=3, use_cache=False))


def test_softmax_scale_is_deepseeks():
    cfg = mla_config()
    assert mla_softmax_scale(cfg.model) == pytest.approx(24 ** -0.5)
    yarn = mla_config("model.rope_scaling=yarn", "model.rope_factor=40", "model.rope_original_max_len=8")
    mscale = 0.1 * math.log(40) + 1
    assert mla_softmax_scale(yarn.model) == pytest.approx(24 ** -0.5 * mscale ** 2)
    off = mla_config("model.rope_scaling=yarn", "model.rope_factor=40", "model.rope_original_max_len=8",
                     "model.rope_mscale_all_dim=0")
    assert mla_softmax_scale(off.model) == pytest.approx(24 ** -0.5)
    transformers = pytest.importorskip("transformers.modeling_rope_utils")
    hf = transformers.yarn_apply_mscale({"rope_type": "yarn", "factor": 40.0, "mscale_all_dim": 1.0}, 24 ** -0.5)
    assert mla_softmax_scale(yarn.model) == pytest.approx(hf)


def test_padded_core_equals_unpadded_attention():
    """q/k (24 wide) and v (12) meet at one head size: the padding changes nothing (a reference without it)."""
    _, model = build()
    attn = model.layers["0"].attn
    q, k = torch.randn(2, 4, 10, 24), torch.randn(2, 4, 10, 24)
    v = torch.randn(2, 4, 10, 12)
    scores = (q @ k.transpose(-1, -2)) * attn.softmax_scale
    scores = scores.masked_fill(torch.ones(10, 10, dtype=torch.bool).triu(1), float("-inf"))
    assert (attn._attend_padded(q, k, v, 0, None) - scores.softmax(-1) @ v).abs().max().item() < 1e-5


def test_recomputation_gives_the_same_gradients():
    _, model = build("model.q_lora_rank=20")
    x = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(2))
    grads = {}
    for mode in ("none", "selective", "full"):
        apply_recompute(model, mode)
        model.zero_grad(set_to_none=True)
        model(x[:, :-1], x[:, 1:]).backward()
        grads[mode] = {n: p.grad.clone() for n, p in model.named_parameters()}
    for mode in ("selective", "full"):
        assert all(torch.equal(grads[mode][n], g) for n, g in grads["none"].items()), mode


def _reference_group_topk(select: torch.Tensor, groups: int, topk_groups: int, k: int) -> torch.Tensor:
    """Token by token, as DeepSeek-V3's gate describes it: groups by their two best scores, then top-k inside."""
    out = []
    for row in select:
        g = row.view(groups, -1)
        best = g.topk(2, -1).values.sum(-1).topk(topk_groups).indices
        allowed = torch.cat([torch.arange(i * g.shape[1], (i + 1) * g.shape[1]) for i in best.tolist()])
        out.append(allowed[row[allowed].topk(k).indices].sort().values)
    return torch.stack(out)


def test_group_limited_router_and_scaled_weights():
    torch.manual_seed(3)
    r = Router(16, 16, 3, "sigmoid", n_groups=4, topk_groups=2, routed_scaling=2.5)
    r.expert_bias.normal_(0, 0.3)  # the selection bias takes part in the group scores
    x = torch.randn(40, 16)
    out = r(x)
    select = out.probs + r.expert_bias
    assert torch.equal(out.experts.sort(-1).values, _reference_group_topk(select, 4, 2, 3))
    chosen = out.probs.gather(-1, out.experts)
    assert torch.allclose(out.weights, 2.5 * chosen / chosen.sum(-1, keepdim=True))
    plain = Router(16, 16, 3, "sigmoid")
    plain.load_state_dict(r.state_dict())
    assert not torch.equal(plain(x).experts.sort(-1).values, out.experts.sort(-1).values)  # the limit bites


def test_first_blocks_stay_dense():
    _, model = build("model.moe_every=1", "model.first_dense_layers=1", "model.n_layers=3", "model.n_experts=4",
                     "model.top_k=2")
    assert [isinstance(b.mlp, MoE) for _, b in model.blocks()] == [False, True, True]


@pytest.mark.parametrize("extra,words", [
    (["model.arch=qwen3"], "has its own attention"),
    (["model.arch=gpt2"], "rotary positions"),
    (["model.n_kv_heads=2"], "no key/value head groups"),
    (["model.head_dim=32"], "set model.head_dim=0"),
    (["model.kv_lora_rank=0"], "model.kv_lora_rank >= 1"),
    (["model.qk_rope_head_dim=7"], "must be even"),
    (["model.moe_every=1", "model.n_experts=8", "model.n_expert_groups=3"], "must divide model.n_experts"),
    (["model.moe_every=1", "model.n_experts=8", "model.top_k=6", "model.n_expert_groups=4", "model.topk_groups=2"],
     "raise model.topk_groups"),
])
def test_config_refusals_name_the_setting(extra, words):
    with pytest.raises(ConfigError, match=words):
        mla_config(*extra)


def test_presets_are_deepseek_v3():
    cfg = load_config(None, ["model.preset=deepseek-v3"])
    with torch.device("meta"):
        model = get_family("llama").build(cfg.model)
    assert sum(p.numel() for p in model.parameters()) == 671_026_404_352  # 671B without the MTP module
    assert sum(isinstance(b.mlp, MoE) for _, b in model.blocks()) == 58
    tiny = load_config(None, ["model.preset=deepseek-v3-tiny", "model.vocab_size=128"])
    assert tiny.model.attention == "mla" and tiny.model.first_dense_layers == 1
