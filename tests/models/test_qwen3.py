"""The qwen3 family: QK-norm attention (placement, KV cache, recomputation), its plan, and a CPU training smoke."""

from __future__ import annotations

import json

import pytest
import torch

from megaloom.cli import main
from megaloom.config import load_config
from megaloom.models import Transformer, apply_recompute
from megaloom.models.layers import apply_rope
from megaloom.models.plan import DECODER_PLAN
from megaloom.models.plan_styles import PartialGrad
from megaloom.models.qwen3.model import Qwen3Attention
from megaloom.models.registry import get_family
from tests.conftest import tiny_overrides
from tests.models.test_transformer import check_kv_cache_matches_full_recompute

VOCAB = 96


def tiny(*extra: str) -> Transformer:
    cfg = load_config(None, ["model.preset=qwen3-tiny", f"model.vocab_size={VOCAB}", "model.d_model=64",
                             "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.max_seq_len=64",
                             "train.seq_len=32", *extra])
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    with torch.no_grad():  # QK-norm weights off their init of ones, so a misplaced norm would show
        for name, p in model.named_parameters():
            if name.endswith("_norm.weight"):
                p.normal_(1.0, 0.3)
    return model


def test_family_traits_presets_and_plan():
    fam = get_family("qwen3")
    assert fam.traits.attention is Qwen3Attention and fam.traits.qk_norm and not fam.traits.bias
    assert {"qwen3-tiny", "qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b", "qwen3-14b", "qwen3-32b"} <= set(
        fam.presets)
    for name, p in fam.presets.items():
        if name != "qwen3-tiny":
            assert (p.get("head_dim") or p["d_model"] // p["n_heads"]) == 128, name  # Qwen3's head_dim
    assert fam.plan["layers.*.attn.q_norm"] == PartialGrad() and fam.plan["layers.*.attn.k_norm"] == PartialGrad()
    qk = ("layers.*.attn.q_norm", "layers.*.attn.k_norm")
    assert {k: v for k, v in fam.plan.items() if k not in qk} == DECODER_PLAN
    m = tiny()
    attn = m.layers["0"].attn
    assert isinstance(attn, Qwen3Attention) and attn.q_norm.weight.shape == (16,) and attn.q_norm.eps == 1e-6


# Non-embedding parameters of the released models (their model cards: 0.44B, 3.6B, 31.2B) and whether the head
# is tied; megaloom's presets must build exactly these shapes.
RELEASED = {"qwen3-0.6b": (0.44e9, True), "qwen3-4b": (3.6e9, True), "qwen3-32b": (31.2e9, False)}


@pytest.mark.parametrize("preset", sorted(RELEASED))
def test_released_shapes_with_wide_heads_build_their_parameter_counts(preset):
    cfg = load_config(None, [f"model.preset={preset}"])
    with torch.device("meta"):
        model = Transformer(cfg.model)
    m, attn = cfg.model, model.layers["0"].attn
    assert attn.head_dim == 128 and attn.q_proj.weight.shape == (m.n_heads * 128, m.d_model)
    assert attn.k_proj.weight.shape == (m.n_kv_heads * 128, m.d_model)
    assert attn.o_proj.weight.shape == (m.d_model, m.n_heads * 128)
    assert model.rope_cos.shape == (m.max_seq_len, 128) and attn.q_norm.weight.shape == (128,)
    non_embedding = sum(p.numel() for n, p in model.named_parameters() if n not in ("tok_emb.weight", "head.weight"))
    expected, tied = RELEASED[preset]
    assert abs(non_embedding / expected - 1) < 0.01, (non_embedding, expected)
    assert m.tie_embeddings is tied and m.vocab_size == 151936


def test_wide_heads_kv_cache_matches_full_recompute():
    model = tiny("model.head_dim=24").eval()  # 4 heads of 24 over d_model 64
    assert model.layers["0"].attn.q_proj.weight.shape == (96, 64)
    check_kv_cache_matches_full_recompute(model, VOCAB)


def test_qk_norm_is_per_head_and_before_rope():
    m = tiny().eval()
    attn = m.layers["0"].attn
    x = torch.randn(2, 10, 64)
    cos, sin = m.rope(10)
    with torch.no_grad():
        got = attn(x, (cos, sin))
        q = apply_rope(attn.q_norm(attn.q_proj(x).view(2, 10, 4, 16)), cos, sin).transpose(1, 2)
        k = apply_rope(attn.k_norm(attn.k_proj(x).view(2, 10, 2, 16)), cos, sin).transpose(1, 2)
        v = attn.v_proj(x).view(2, 10, 2, 16).transpose(1, 2)
        k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        expected = attn.o_proj(y.transpose(1, 2).reshape(2, 10, 64))
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)


def test_kv_cache_generation_matches_full_recompute():
    check_kv_cache_matches_full_recompute(tiny().eval(), VOCAB)


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recompute_gives_the_same_gradients(mode):
    x = torch.randint(0, VOCAB, (2, 17))

    def grads(m):
        m(x[:, :-1], x[:, 1:]).backward()
        return {n: p.grad for n, p in m.named_parameters()}

    plain = grads(tiny())
    m = tiny()
    apply_recompute(m, mode)
    got = grads(m)
    assert got["layers.0.attn.q_norm.weight"].abs().sum() > 0
    for n, g in plain.items():
        assert torch.equal(got[n], g), n


def test_qkv_bias_builds_biases_on_q_k_v_only():
    attn = tiny("model.qkv_bias=true").layers["1"].attn
    assert all(getattr(attn, f"{p}_proj").bias is not None for p in "qkv") and attn.o_proj.bias is None


@pytest.mark.parametrize("head_dim", [0, 48])
def test_cli_training_smoke_loss_falls(small_corpus, tmp_path, head_dim):
    """`megaloom train model.preset=qwen3-tiny train.steps=20` on the small corpus (the preset's own shape; and
    with model.head_dim=48, heads wider than 128 / 4, as Qwen3-0.6B's are)."""
    run = tmp_path / "run"
    data = [o for o in tiny_overrides(small_corpus, run) if not o.startswith("model.")]
    assert main(["train", "model.preset=qwen3-tiny", "train.steps=20", "checkpoint.every=0", *data,
                 f"model.head_dim={head_dim}"]) == 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    loss = {r["step"]: r["loss"] for r in records}
    assert sorted(loss) == list(range(1, 21))
    first, last = sum(loss[s] for s in (1, 2, 3)) / 3, sum(loss[s] for s in (18, 19, 20)) / 3
    assert last < first - 0.5, (first, last)
    resolved = load_config(run / "config.yaml")
    assert resolved.model.arch == "qwen3" and resolved.model.d_model == 128 and resolved.model.n_layers == 4
    assert resolved.model.head_dim == (head_dim or 32)  # resolved into config.yaml as n_kv_heads is
