"""Hugging Face interchange of the gemma family (Gemma2ForCausalLM), checked by logits and tensors: sandwich
(1 + w) norms, GeGLU, the scaled embedding, heads wider than d_model / n_heads, alternating sliding-window layers
over a sequence longer than the window, attention and final-logit soft-capping (every released Gemma 2 has both)
over 512 positions; and what it refuses, by name."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from megaloom.convert import ConversionError, from_hf, to_hf  # noqa: E402
from tests.checkpoint.hf_common import hf_logits, megaloom_from_run  # noqa: E402

ATOL = 1e-5
VOCAB = 256
WINDOW = 8  # shorter than the 24 tokens compared, so the local layers' window matters
pytestmark = pytest.mark.filterwarnings("ignore:.*has no tokenizer.json")


def hf_config(**changes) -> transformers.Gemma2Config:
    return transformers.Gemma2Config(**{**dict(
        hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        query_pre_attn_scalar=32, num_hidden_layers=4, vocab_size=VOCAB, max_position_embeddings=64,
        rope_theta=500.0, rms_norm_eps=1e-6, sliding_window=WINDOW, attn_logit_softcapping=None,
        final_logit_softcapping=None, tie_word_embeddings=True, attn_implementation="eager"), **changes})


def hf_model(**changes):
    """A tiny random Gemma2ForCausalLM in float32, every norm randomised around 0 (its (1 + w) is then around 1)."""
    torch.manual_seed(0)
    model = transformers.Gemma2ForCausalLM(hf_config(**changes)).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.2)
    return model.eval()


def tokens(n: int = 24) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, n), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("window", [WINDOW, 0])
def test_hf_gemma2_imports_with_equal_logits_and_exports_the_same_tensors(tmp_path, window):
    changes = {} if window else {"layer_types": ["full_attention"] * 4}
    ref = hf_model(**changes)
    ref.save_pretrained(tmp_path / "hf")
    expected = hf_logits(ref, tokens())

    from_hf(tmp_path / "hf", tmp_path / "run")
    model, cfg = megaloom_from_run(tmp_path / "run")
    m = cfg.model
    assert (m.arch, m.d_model, m.n_heads, m.n_kv_heads, m.head_dim, m.ffn_dim) == ("gemma", 64, 4, 2, 32, 96)
    assert m.sliding_window == window and m.tie_embeddings
    assert [model.layers[str(i)].attn.window for i in range(4)] == [window, 0, window, 0]
    with torch.no_grad():
        torch.testing.assert_close(model(tokens()), expected, atol=ATOL, rtol=0)

    to_hf(tmp_path / "run", tmp_path / "back", show_progress=False)
    hf_cfg = json.loads((tmp_path / "back" / "config.json").read_text())
    assert hf_cfg["architectures"] == ["Gemma2ForCausalLM"] and hf_cfg["head_dim"] == 32
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back", attn_implementation="eager").eval()
    assert type(back) is transformers.Gemma2ForCausalLM
    assert back.config.layer_types == ref.config.layer_types
    for k, v in ref.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    torch.testing.assert_close(hf_logits(back, tokens()), expected, atol=ATOL, rtol=0)


def test_the_window_matters_here():
    """The comparison above would not see a window ignored: a model without it computes other logits."""
    with_window, without = hf_model(), hf_model(layer_types=["full_attention"] * 4)
    assert not torch.allclose(hf_logits(with_window, tokens()), hf_logits(without, tokens()), atol=1e-3)


GEMMA2 = {"model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"], "hidden_size": 64,
          "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
          "query_pre_attn_scalar": 32, "num_hidden_layers": 2, "vocab_size": 64, "max_position_embeddings": 32,
          "sliding_window": 8, "attn_logit_softcapping": None, "final_logit_softcapping": None}


@pytest.mark.parametrize("cfg,field", [
    ({**GEMMA2, "attn_logit_softcapping": -1.0}, "attn_logit_softcapping"),
    ({**GEMMA2, "query_pre_attn_scalar": 0}, "query_pre_attn_scalar"),
    ({**GEMMA2, "hidden_activation": "gelu"}, "hidden_activation"),
    ({**GEMMA2, "attention_bias": True}, "attention_bias"),
    ({**GEMMA2, "layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
])
def test_unsupported_gemma2_configs_name_the_field(tmp_path, cfg, field):
    d = tmp_path / "hfcfg"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConversionError, match=field):
        from_hf(d, tmp_path / "run")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("attn_cap,final_cap,scalar", [(50.0, 30.0, 32), (1.0, 1.0, 32), (50.0, 30.0, 48)])
def test_soft_capped_gemma2_imports_and_exports_with_equal_logits_over_512_positions(tmp_path, attn_cap, final_cap,
                                                                                      scalar):
    """Issue 49: the released caps (50 / 30: read and written as they are) and caps this model's scores and logits
    reach (1 / 1, queries, keys and embeddings scaled up: the tanh bends them, so an uncapped or misplaced cap
    shows), against transformers' eager Gemma2ForCausalLM in float32 over 512 positions (windows of 64 on the local
    layers); and a query scale other than head_dim's (scalar 48 for heads of 32, as Gemma 2 27B's 144 for 128)."""
    caps = dict(attn_logit_softcapping=attn_cap, final_logit_softcapping=final_cap, max_position_embeddings=512,
                sliding_window=64, query_pre_attn_scalar=scalar)
    ref = hf_model(**caps)
    with torch.no_grad():  # scores and logits of several units, where the tanh bends
        for name, p in ref.named_parameters():
            if "q_proj" in name or "k_proj" in name:
                p.mul_(8.0)
            elif "embed_tokens" in name:
                p.mul_(5.0)
    ref.save_pretrained(tmp_path / "hf")
    x = tokens(512)
    expected = hf_logits(ref, x)

    from_hf(tmp_path / "hf", tmp_path / "run")
    model, cfg = megaloom_from_run(tmp_path / "run")
    assert (cfg.model.attn_softcap, cfg.model.final_softcap) == (attn_cap, final_cap)
    assert cfg.model.query_pre_attn_scalar == (0 if scalar == 32 else scalar)
    with torch.no_grad():
        got = model(x)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    if attn_cap < 50:
        assert got.abs().max() < final_cap and expected.abs().max() > 0.5 * final_cap  # the cap binds
        for key in ("attn_softcap", "final_softcap"):  # each cap matters on its own
            import dataclasses

            from megaloom.models.registry import get_family

            other = get_family("gemma").build(dataclasses.replace(cfg.model, **{key: 0.0}))
            other.load_state_dict(model.state_dict())
            with torch.no_grad():
                assert (other.eval()(x) - expected).abs().max() > 100 * ATOL, key
    if scalar != 32:  # the scale matters too
        import dataclasses

        from megaloom.models.registry import get_family

        other = get_family("gemma").build(dataclasses.replace(cfg.model, query_pre_attn_scalar=0))
        other.load_state_dict(model.state_dict())
        with torch.no_grad():
            assert (other.eval()(x) - expected).abs().max() > 100 * ATOL

    to_hf(tmp_path / "run", tmp_path / "back", show_progress=False)
    hf_cfg = json.loads((tmp_path / "back" / "config.json").read_text())
    assert (hf_cfg["attn_logit_softcapping"], hf_cfg["final_logit_softcapping"]) == (attn_cap, final_cap)
    assert hf_cfg["query_pre_attn_scalar"] == scalar
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back", attn_implementation="eager").eval()
    torch.testing.assert_close(hf_logits(back, x), expected, atol=ATOL, rtol=0)


def test_a_gemma2_config_without_the_cap_fields_takes_gemma2s_defaults(tmp_path):
    """Gemma2Config's defaults are the released caps (50 / 30): a config.json that leaves them out has them."""
    from megaloom.models.gemma.hf import from_hf_config

    cfg = {k: v for k, v in GEMMA2.items() if not k.endswith("softcapping")}
    assert {k: v for k, v in from_hf_config(cfg, "config.json").items() if "softcap" in k} == {
        "attn_softcap": 50.0, "final_softcap": 30.0}
