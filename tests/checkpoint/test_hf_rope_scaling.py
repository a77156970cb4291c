"""RoPE frequency scaling (model.rope_scaling): Llama 3.1/3.2/3.3's 'llama3' and Qwen's YaRN, imported from the
released config.json files (shrunk to tiny sizes, RoPE settings kept) and exported back, checked by logits against
transformers at positions far enough out for the scaling to matter, in a full forward and in KV-cache decoding."""

from __future__ import annotations

import json

import pytest
import torch

from megaloom.config import ConfigError, load_config

transformers = pytest.importorskip("transformers")

from megaloom.checkpoint import save_checkpoint  # noqa: E402
from megaloom.convert import from_hf, to_hf  # noqa: E402
from megaloom.models import Transformer  # noqa: E402
from tests.checkpoint.hf_common import megaloom_from_run  # noqa: E402

ATOL = 1e-4
VOCAB = 128
SEQ = 1024  # positions up to here: the scaled (low) frequencies turn visibly differently
pytestmark = pytest.mark.filterwarnings("ignore:.*has no tokenizer.json")
SMALL = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
             vocab_size=VOCAB)

# config.json of the released models, as on the Hub (transformers 4.x layout: rope_scaling + rope_theta); only the
# sizes are replaced by SMALL. Llama-3.1-8B (3.3-70B has the same rope_scaling), Llama-3.2-1B, and Qwen3-8B with
# the YaRN block its model card adds for 128k contexts.
LLAMA_31_8B = {"architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
               "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
               "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 131072,
               "mlp_bias": False, "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32,
               "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
               "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 8192, "rope_type": "llama3"},
               "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
               "vocab_size": 128256}
LLAMA_32_1B = {**LLAMA_31_8B, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
               "head_dim": 64, "tie_word_embeddings": True,
               "rope_scaling": {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 8192, "rope_type": "llama3"}}
QWEN3_8B_YARN = {"architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
                 "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
                 "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 12288,
                 "max_position_embeddings": 131072, "max_window_layers": 36, "model_type": "qwen3",
                 "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
                 "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
                 "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": False,
                 "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936}


def small(cfg: dict) -> dict:
    out = {**cfg, **SMALL}
    if "head_dim" in cfg:
        out["head_dim"] = SMALL["hidden_size"] // SMALL["num_attention_heads"]
    return out


def hf_from_dict(cfg: dict, tmp_path):
    """A random float32 HF model of ``cfg``, saved with ``cfg`` itself as its config.json (the released layout)."""
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(d)).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)
            elif "q_proj" in name or "k_proj" in name:  # sharp attention: positions matter to the logits
                p.normal_(0.0, 0.25)
    model.save_pretrained(d)
    (d / "config.json").write_text(json.dumps(cfg))  # the Hub's 4.x layout, not what save_pretrained wrote
    return model.eval(), d


def tokens(n: int = SEQ) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("name,released,expect", [
    ("llama-3.1-8b", LLAMA_31_8B, dict(rope_scaling="llama3", rope_factor=8.0, rope_original_max_len=8192,
                                       rope_low_freq_factor=1.0, rope_high_freq_factor=4.0, rope_theta=500000.0)),
    ("llama-3.2-1b", LLAMA_32_1B, dict(rope_scaling="llama3", rope_factor=32.0, tie_embeddings=True)),
    ("qwen3-8b-yarn", QWEN3_8B_YARN, dict(arch="qwen3", rope_scaling="yarn", rope_factor=4.0,
                                          rope_original_max_len=32768, rope_beta_fast=32.0, rope_beta_slow=1.0,
                                          rope_attention_factor=0.0, rope_truncate=True)),
])
def test_released_rope_scaling_imports_and_exports_with_equal_logits(tmp_path, name, released, expect):
    ref, hf_dir = hf_from_dict(small(released), tmp_path)
    x = tokens()
    with torch.no_grad():
        expected = ref(x).logits

    from_hf(hf_dir, tmp_path / "run")
    model, cfg = megaloom_from_run(tmp_path / "run")
    for key, value in expect.items():
        assert getattr(cfg.model, key) == value, key
    with torch.no_grad():
        got = model(x)
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
        # generation reads the same tables: a KV-cache prefill, then one decoded token at position SEQ - 1
        caches = model.new_caches(1, SEQ)
        model(x[:, :-1], caches=caches, pos=0)
        torch.testing.assert_close(model(x[:, -1:], caches=caches, pos=SEQ - 1)[:, -1], expected[:, -1],
                                   atol=ATOL, rtol=0)
        # the scaling matters here: the same weights with plain RoPE are far off (so this test can fail)
        plain = Transformer(load_config(tmp_path / "run" / "config.yaml", ["model.rope_scaling=none"]).model)
        plain.load_state_dict(model.state_dict())
        assert (plain.eval()(x) - expected).abs().max() > 100 * ATOL

    to_hf(tmp_path / "run", tmp_path / "back", show_progress=False)
    written = json.loads((tmp_path / "back" / "config.json").read_text())
    assert written["rope_parameters"]["rope_type"] == written["rope_scaling"]["rope_type"] == expect["rope_scaling"]
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    with torch.no_grad():
        torch.testing.assert_close(back(x).logits, expected, atol=ATOL, rtol=0)


def test_megaloom_yarn_run_exports_and_imports_back(tmp_path):
    """megaloom -> HF -> megaloom, with the YaRN settings transformers takes from config.json only when given
    (attention_factor, truncate=false)."""
    cfg = load_config(None, ["model.preset=qwen3-tiny", f"model.vocab_size={VOCAB}", "model.d_model=64",
                             "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=96",
                             f"model.max_seq_len={SEQ}", "model.tie_embeddings=false", "model.rope_scaling=yarn",
                             "model.rope_factor=8", "model.rope_original_max_len=256", "model.rope_beta_fast=16",
                             "model.rope_beta_slow=2", "model.rope_attention_factor=1.3", "model.rope_truncate=false",
                             "train.seq_len=32", f"run.dir={tmp_path / 'run'}"])
    torch.manual_seed(0)
    model = Transformer(cfg.model).eval()
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(cfg.to_yaml())
    save_checkpoint(run / "checkpoints", 1, model, None, {"model": cfg.model.__dict__}, keep=1)
    to_hf(run, tmp_path / "hf", show_progress=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    x = tokens(512)
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, model(x), atol=ATOL, rtol=0)
    from_hf(tmp_path / "hf", tmp_path / "run2")
    again, cfg2 = megaloom_from_run(tmp_path / "run2")
    keys = [k for k in vars(cfg.model) if k.startswith("rope_")]
    assert {k: getattr(cfg2.model, k) for k in keys} == {k: getattr(cfg.model, k) for k in keys}
    for k, v in model.state_dict().items():
        assert torch.equal(again.state_dict()[k], v), k


@pytest.mark.parametrize("overrides,key", [
    (["model.rope_scaling=llama3", "model.rope_factor=8"], "model.rope_original_max_len"),
    (["model.rope_scaling=llama3", "model.rope_original_max_len=8192", "model.rope_high_freq_factor=1"],
     "model.rope_low_freq_factor"),
    (["model.rope_scaling=yarn", "model.rope_original_max_len=8192", "model.rope_factor=0"], "model.rope_factor"),
    (["model.preset=tiny-gpt2", "model.rope_scaling=yarn", "model.rope_original_max_len=64"], "model.rope_scaling"),
])
def test_rope_scaling_settings_are_checked(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, overrides)


@pytest.mark.parametrize("kind", ["plain", "llama3", "yarn"])
def test_rope_tables_are_transformers_to_the_bit_over_4096_positions(kind):
    """Issue 49: the cos/sin tables in float32, operation for operation as transformers' rotary embeddings (an exact
    float64 angle drifts from float32's rounding with the position, up to 5e-5 in a Gemma 2's logits by position
    500); equal for plain RoPE, Llama 3.1's scaling and YaRN."""
    from megaloom.models.layers import RopeScaling, rope_tables

    n, head = 4096, 128
    if kind == "llama3":
        hf = transformers.LlamaConfig(hidden_size=256, num_attention_heads=2, rope_theta=500000.0,
                                      max_position_embeddings=16384,
                                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
        theta, scaling = 500000.0, RopeScaling(kind="llama3", factor=8.0, original_max_len=8192)
    elif kind == "yarn":
        yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}
        hf = transformers.Qwen3Config(hidden_size=256, num_attention_heads=2, head_dim=head, rope_theta=1e6,
                                      max_position_embeddings=n, rope_scaling=yarn)
        theta, scaling = 1e6, RopeScaling(kind="yarn", factor=4.0, original_max_len=1024)
    else:
        hf = transformers.LlamaConfig(hidden_size=256, num_attention_heads=2, rope_theta=10000.0,
                                      max_position_embeddings=n)
        theta, scaling = 10000.0, None
    rotary = (transformers.models.qwen3.modeling_qwen3.Qwen3RotaryEmbedding if kind == "yarn"
              else transformers.models.llama.modeling_llama.LlamaRotaryEmbedding)(hf)
    cos, sin = rotary(torch.zeros(1, n, head), torch.arange(n)[None])
    ours = rope_tables(head, n, theta, scaling)
    assert torch.equal(ours[0], cos[0]) and torch.equal(ours[1], sin[0])
