"""The gemma family: its block (sandwich (1 + w) norms, GeGLU, alternating windows), the scaled embedding, its
plan, KV-cache decoding through windowed and global layers, recomputation, attention and final-logit soft-capping
(the math core, train.attention=auto's choice), refusals and a CPU training smoke. The HF round trip is
tests/checkpoint/test_hf_gemma.py; tp and pp parity the world suites' gemma cases."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from megaloom.cli import main
from megaloom.config import ConfigError, load_config
from megaloom.models import apply_recompute
from megaloom.models.gemma.model import GeGLU, GemmaModel, GemmaRMSNorm
from megaloom.models.plan import DECODER_PLAN
from megaloom.models.plan_styles import SequenceParallel
from megaloom.models.registry import get_family
from tests.conftest import tiny_overrides
from tests.models.test_transformer import check_kv_cache_matches_full_recompute

VOCAB = 96


def tiny(*extra: str) -> GemmaModel:
    cfg = load_config(None, ["model.preset=gemma-tiny", f"model.vocab_size={VOCAB}", "model.d_model=64",
                             "model.n_layers=4", "model.head_dim=24", "model.max_seq_len=64", "model.sliding_window=5",
                             "train.seq_len=32", *extra])
    torch.manual_seed(0)
    model = get_family("gemma").build(cfg.model)
    with torch.no_grad():  # norms off their init of 0, so a misplaced (1 + w) would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.3)
    return model


def test_family_builds_its_own_module_with_the_shared_names():
    fam = get_family("gemma")
    assert fam.module is GemmaModel and not fam.dense_decoder
    assert {k: v for k, v in fam.plan.items() if "post_" not in k} == DECODER_PLAN
    assert fam.plan["layers.*.post_attn_norm"] == fam.plan["layers.*.post_mlp_norm"] == SequenceParallel()
    m = tiny()
    block = m.layers["0"]
    assert isinstance(block.mlp, GeGLU) and isinstance(block.post_mlp_norm, GemmaRMSNorm)
    assert block.attn.q_proj.weight.shape == (4 * 24, 64)  # heads wider than 64 / 4
    assert [m.layers[str(i)].attn.window for i in range(4)] == [5, 0, 5, 0]  # local, global, local, global
    fresh = get_family("gemma").build(m.cfg)
    assert all(not p.detach().any() for n, p in fresh.named_parameters() if "norm" in n)  # (1 + 0) = 1


def test_block_and_embedding_compute_what_gemma2_does():
    m = tiny().eval()
    block, x = m.layers["1"], torch.randn(2, 10, 64)
    cos, sin = m.rope(10)

    def rms(norm, t):
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + norm.eps) * (1 + norm.weight)

    with torch.no_grad():
        h = x + rms(block.post_attn_norm, block.attn(rms(block.attn_norm, x), (cos, sin)))
        mlp = block.mlp
        u = rms(block.mlp_norm, h)
        expected = h + rms(block.post_mlp_norm,
                           mlp.down_proj(F.gelu(mlp.gate_proj(u), approximate="tanh") * mlp.up_proj(u)))
        torch.testing.assert_close(block(x, (cos, sin)), expected, atol=1e-5, rtol=1e-5)
        ids = torch.randint(0, VOCAB, (2, 5))
        torch.testing.assert_close(m.embed(ids), m.tok_emb(ids) * 64 ** 0.5)


def test_kv_cache_generation_matches_full_recompute_through_windows():
    check_kv_cache_matches_full_recompute(tiny().eval(), VOCAB)  # 27 tokens, windows of 5 on even layers


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
    for n, g in plain.items():
        assert torch.equal(got[n], g), n


@pytest.mark.parametrize("override,field", [("model.parallel_block=true", "model.parallel_block"),
                                            ("model.moe_every=1", "model.moe_every")])
def test_what_gemma_does_not_build_is_refused(override, field):
    with pytest.raises(ConfigError, match=field):
        load_config(None, ["model.preset=gemma-tiny", override])


def test_released_shapes():
    for preset, n in (("gemma2-2b", 2.61e9), ("gemma2-9b", 9.24e9), ("gemma2-27b", 27.2e9)):  # the models' cards
        cfg = load_config(None, [f"model.preset={preset}"])
        with torch.device("meta"):
            model = get_family("gemma").build(cfg.model)
        total = sum(p.numel() for p in model.parameters())  # tied head: counted once
        assert abs(total / n - 1) < 0.01, (preset, total)


def test_cli_training_smoke_loss_falls(small_corpus, tmp_path):
    """`megaloom train model.preset=gemma-tiny train.steps=20` on the small corpus (window 64 on even layers)."""
    run = tmp_path / "run"
    data = [o for o in tiny_overrides(small_corpus, run) if not o.startswith("model.")]
    assert main(["train", "model.preset=gemma-tiny", "train.steps=20", "checkpoint.every=0", *data]) == 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    loss = {r["step"]: r["loss"] for r in records}
    first, last = sum(loss[s] for s in (1, 2, 3)) / 3, sum(loss[s] for s in (18, 19, 20)) / 3
    assert last < first - 0.5, (first, last)
    assert load_config(run / "config.yaml").model.arch == "gemma"


def test_soft_capped_attention_core_is_the_capped_softmax():
    """The math core: softmax(cap * tanh(q k^T / sqrt(d) / cap)) v under the causal window, grouped-query heads
    shared; with a cap far above the scores it is SDPA's attention."""
    from megaloom.models.attention import Attention, attention_mask, softcapped_attention

    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 9, 8) * 3, torch.randn(2, 2, 9, 8) * 3, torch.randn(2, 2, 9, 8)
    mask = attention_mask(9, 9, 0, 4, "cpu")
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    s = (q @ kk.transpose(-2, -1)) / 8 ** 0.5
    expected = (torch.tanh(s / 2.0) * 2.0).masked_fill(~mask, float("-inf")).softmax(-1) @ vv
    torch.testing.assert_close(softcapped_attention(q, k, v, 2.0, None, mask), expected)
    plain = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask)
    torch.testing.assert_close(softcapped_attention(q, k, v, 1e6, None, mask), plain, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(softcapped_attention(q, k, v, 2.0, None, mask), plain, atol=1e-2)
    attn = Attention(32, 4, 2, False, 0.0, 4, head_dim=8)
    attn.softcap = 2.0
    torch.testing.assert_close(attn._core(q, k, v, 0), expected)  # the layer takes the math core


def test_soft_capped_model_decodes_with_its_cache_and_caps_its_logits():
    m = tiny("model.attn_softcap=1.0", "model.final_softcap=0.5").eval()
    assert all(m.layers[str(i)].attn.softcap == 1.0 for i in range(4))
    with torch.no_grad():
        assert m(torch.randint(0, VOCAB, (2, 9))).abs().max() < 0.5
    check_kv_cache_matches_full_recompute(m, VOCAB)


@pytest.mark.parametrize("overrides,message", [
    (["model.preset=tiny", "model.attn_softcap=50"], "model.attn_softcap=50 with model.arch=llama: this family does "
                                                     "not build soft-capping"),
    (["model.preset=gemma-tiny", "model.final_softcap=-1"], "model.final_softcap must be >= 0"),
    (["model.preset=gemma-tiny", "model.attn_softcap=50", "train.attention=cudnn"], "the fused attention kernels "
                                                                                     "cannot soft-cap"),
    (["model.preset=gemma-tiny", "model.attn_softcap=50", "parallel.cp=2"], "parallel.cp=2"),
    (["model.preset=gemma-tiny", "model.final_softcap=30", "train.fused_loss=true"], "train.fused_loss=true"),
    (["model.preset=tiny", "model.query_pre_attn_scalar=144"], "this family scales queries by head_dim"),
    (["model.preset=gemma-tiny", "model.query_pre_attn_scalar=-1"], "must be > 0"),
])
def test_soft_capping_where_it_cannot_run_is_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_attention_auto_picks_the_math_core_for_soft_capped_scores_and_says_so(small_corpus, tmp_path, capsys):
    """train.attention=auto -> math on any device (the fused kernels cannot cap), fused_loss off for the final cap;
    the start-up line names both, also on CPU; the released Gemma 2 presets carry the caps."""
    from megaloom.planning.levers import choose_levers

    cfg = load_config(None, ["model.preset=gemma2-2b"])
    assert (cfg.model.attn_softcap, cfg.model.final_softcap) == (50.0, 30.0)
    for device, cc in (("cpu", None), ("cuda", (9, 0))):
        chosen = {c.key: c.value for c in choose_levers(cfg, device, cc)}
        assert chosen["train.attention"] == "math" and chosen["train.fused_loss"] is False
    run = tmp_path / "run"
    data = [o for o in tiny_overrides(small_corpus, run) if not o.startswith("model.")]
    assert main(["train", "model.preset=gemma-tiny", "model.n_layers=2", "model.attn_softcap=50",
                 "model.final_softcap=30", "train.steps=2", "checkpoint.every=0", *data]) == 0
    out = capsys.readouterr().out
    assert "attention math (model.attn_softcap: no fused kernel soft-caps the scores)" in out
    assert "fused_loss off (model.final_softcap: the chunks would skip the cap)" in out
    assert "attention math)" in out  # the memory plan's line: the math core's saved scores
    assert load_config(run / "config.yaml").train.attention == "math"


def test_soft_capped_scores_under_a_document_block_mask_take_flexattention_score_mod():
    """On CUDA a document mask is FlexAttention's BlockMask; the cap then rides on its score_mod. Compiled on CPU
    here (~15 s): the same logits as the math core under the dense document mask."""
    from megaloom.models.documents import Documents

    m = tiny("model.attn_softcap=2.0", "model.final_softcap=5.0", "model.sliding_window=0").eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "q_proj" in name or "k_proj" in name:
                p.mul_(6.0)  # scores of several units: the cap bends them
    x = torch.randint(0, VOCAB - 1, (2, 48), generator=torch.Generator().manual_seed(5))
    x[:, 20] = x[:, 33] = VOCAB - 1
    docs = Documents.from_tokens(x, VOCAB - 1)
    with torch.no_grad():
        flex, dense = m(x, docs=docs.with_mask(0, flex=True)), m(x, docs=docs.with_mask(0, flex=False))
        assert (m(x) - dense).abs().max() > 1e-2  # the documents matter
    torch.testing.assert_close(flex, dense, atol=1e-5, rtol=1e-5)
