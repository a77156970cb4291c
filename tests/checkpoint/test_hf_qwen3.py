"""Hugging Face interchange of the qwen3 family (Qwen3ForCausalLM), checked by logits and tensors (heads of
d_model / n_heads, and wider or narrower ones through model.head_dim), and what it refuses (HF's attention_bias,
sliding windows; megaloom's q/k/v-only biases)."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from megaloom.checkpoint import save_checkpoint  # noqa: E402
from megaloom.cli import main  # noqa: E402
from megaloom.config import load_config  # noqa: E402
from megaloom.convert import ConversionError, from_hf, to_hf  # noqa: E402
from megaloom.models import Transformer  # noqa: E402
from tests.checkpoint.hf_common import hf_logits, megaloom_from_run, saved_run  # noqa: E402

ATOL = 1e-5
VOCAB = 256
pytestmark = pytest.mark.filterwarnings("ignore:.*has no tokenizer.json")


def hf_config(tied: bool, **changes) -> transformers.Qwen3Config:
    return transformers.Qwen3Config(**{**dict(
        hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_hidden_layers=2, vocab_size=VOCAB, max_position_embeddings=64, rope_theta=500.0, rms_norm_eps=1e-6,
        tie_word_embeddings=tied), **changes})


def hf_model(tied: bool, head_dim: int = 16):
    """A tiny random Qwen3ForCausalLM in float32; every norm (QK-norms included) randomised, so a swapped or
    misplaced norm would show in the logits. ``head_dim`` 16 = hidden 64 / 4 heads; others as Qwen3-0.6B's."""
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(hf_config(tied, head_dim=head_dim)).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)
    return model.eval()


def tokens(n: int = 24) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, n), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("tied,head_dim", [(False, 16), (True, 16), (True, 24), (False, 8)])
def test_hf_qwen3_imports_with_equal_logits_and_exports_the_same_tensors(tmp_path, tied, head_dim):
    """head_dim 24 (wider than 64 / 4, as Qwen3-0.6B's 128 over 1024 / 16) and 8 (narrower): model.head_dim."""
    ref = hf_model(tied, head_dim)
    ref.save_pretrained(tmp_path / "hf")
    expected = hf_logits(ref, tokens())

    from_hf(tmp_path / "hf", tmp_path / "run")
    model, cfg = megaloom_from_run(tmp_path / "run")
    m = cfg.model
    assert (m.arch, m.d_model, m.n_heads, m.n_kv_heads, m.ffn_dim, m.tie_embeddings) == ("qwen3", 64, 4, 2, 96, tied)
    assert m.head_dim == head_dim and model.layers["0"].attn.q_proj.weight.shape == (4 * head_dim, 64)
    assert (m.rope_theta, m.norm_eps, m.qkv_bias) == (500.0, 1e-6, False)
    assert "layers.1.attn.k_norm.weight" in model.state_dict()
    with torch.no_grad():
        torch.testing.assert_close(model(tokens()), expected, atol=ATOL, rtol=0)

    to_hf(tmp_path / "run", tmp_path / "back", show_progress=False)
    hf_cfg = json.loads((tmp_path / "back" / "config.json").read_text())
    assert hf_cfg["architectures"] == ["Qwen3ForCausalLM"] and hf_cfg["model_type"] == "qwen3"
    assert hf_cfg["head_dim"] == head_dim and hf_cfg["attention_bias"] is False
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert type(back) is transformers.Qwen3ForCausalLM
    assert back.state_dict().keys() == ref.state_dict().keys()
    for k, v in ref.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    torch.testing.assert_close(hf_logits(back, tokens()), expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("head_dim", [0, 32])
def test_trained_qwen3_round_trips_through_megaloom_convert(tmp_path, capsys, head_dim):
    """A megaloom qwen3 run -> `megaloom convert --to-hf` -> transformers (equal logits) -> `--from-hf` -> the
    same tensors; with model.head_dim=32 too (heads twice d_model / n_heads)."""
    # 2 AdamW steps move the weights (QK-norms included) off their init
    run, model = saved_run(tmp_path, ["model.preset=qwen3-tiny", f"model.vocab_size={VOCAB}", "model.d_model=64",
                                      "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=96",
                                      "model.max_seq_len=64", "model.tie_embeddings=false", "train.seq_len=32",
                                      f"model.head_dim={head_dim}", f"run.dir={tmp_path / 'run'}"], tokens(32), 2)

    assert main(["convert", "--to-hf", str(run), str(tmp_path / "hf"), "--no-progress"]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(hf) is transformers.Qwen3ForCausalLM
    with torch.no_grad():
        torch.testing.assert_close(hf_logits(hf, tokens()), model.eval()(tokens()), atol=ATOL, rtol=0)

    assert main(["convert", "--from-hf", str(tmp_path / "hf"), str(tmp_path / "run2")]) == 0
    assert "megaloom train --config" in capsys.readouterr().out
    again, cfg2 = megaloom_from_run(tmp_path / "run2")
    assert cfg2.model.arch == "qwen3" and cfg2.model.tie_embeddings is False
    assert cfg2.model.head_dim == (head_dim or 16)
    for k, v in model.state_dict().items():
        assert torch.equal(again.state_dict()[k], v), k


def hf_dir(tmp_path, cfg: dict):
    d = tmp_path / "hfcfg"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return d


QWEN3 = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": 64, "intermediate_size": 96,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 1,
         "vocab_size": 64, "max_position_embeddings": 32}


@pytest.mark.parametrize("cfg,field", [
    ({**QWEN3, "attention_bias": True}, "attention_bias"),
    ({**QWEN3, "use_sliding_window": True, "sliding_window": 8}, "use_sliding_window"),
    ({**QWEN3, "layer_types": ["sliding_attention"]}, "layer_types"),
    ({**QWEN3, "hidden_act": "gelu"}, "hidden_act"),
    ({**QWEN3, "rope_scaling": {"rope_type": "longrope", "factor": 4.0}}, "rope_scaling"),
])
def test_unsupported_qwen3_configs_name_the_field(tmp_path, cfg, field):
    with pytest.raises(ConversionError, match=field):
        from_hf(hf_dir(tmp_path, cfg), tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_a_config_without_head_dim_takes_qwen3s_default_128():
    """Qwen3Config's head_dim is 128 when config.json has none (once refused: 128 != 64 / 4)."""
    from megaloom.convert.hf_config import model_settings

    settings = model_settings({k: v for k, v in QWEN3.items() if k != "head_dim"}, "config.json")
    assert settings["head_dim"] == 128 and settings["d_model"] == 64 and settings["n_heads"] == 4


def test_qkv_bias_is_not_exported(tmp_path):
    cfg = load_config(None, ["model.preset=qwen3-tiny", "model.vocab_size=64", "model.d_model=32", "model.n_layers=1",
                             "model.n_heads=2", "model.n_kv_heads=2", "model.max_seq_len=32", "model.qkv_bias=true",
                             "train.seq_len=32"])
    model = Transformer(cfg.model)
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(cfg.to_yaml())
    save_checkpoint(run / "checkpoints", 1, model, None, {}, keep=1)
    with pytest.raises(ConversionError, match=r"model\.qkv_bias=true: Qwen3ForCausalLM's attention_bias"):
        to_hf(run, tmp_path / "out", show_progress=False)
    assert not (tmp_path / "out").exists()
