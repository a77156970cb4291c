"""The gemma family: its block (sandwich (1 + w) norms, GeGLU, alternating windows), the scaled embedding, its
plan, KV-cache decoding through windowed and global layers, recomputation, refusals and a CPU training smoke. The
HF round trip is tests/checkpoint/test_hf_gemma.py; tp and pp parity the world suites' gemma cases."""

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
from megaloom.models.registry import get_family
from megaloom.parallel.styles import SequenceParallel
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
    for preset, n in (("gemma2-2b", 2.61e9), ("gemma2-9b", 9.24e9)):  # the models' cards: 2.61B and 9.24B
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
