"""Mixture-of-Experts interchange: MixtralForCausalLM <-> llama with model.moe_every=1, Qwen3MoeForCausalLM <-> qwen3
with MoE blocks. Checked by logits against transformers on the released config.json files shrunk to tiny sizes, in
the Hub's per-expert layout and transformers 5's stacked one, both ways; and what neither class can express."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from safetensors.torch import save_file  # noqa: E402

from megaloom.checkpoint import save_checkpoint  # noqa: E402
from megaloom.config import load_config  # noqa: E402
from megaloom.convert import ConversionError, from_hf, to_hf  # noqa: E402
from megaloom.models import Transformer  # noqa: E402
from tests.checkpoint.hf_common import megaloom_from_run  # noqa: E402
from tests.checkpoint.hf_common import saved_run as saved_run_of  # noqa: E402

ATOL = 1e-4
VOCAB = 128
pytestmark = pytest.mark.filterwarnings("ignore:.*has no tokenizer.json")
SMALL = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, vocab_size=VOCAB)

# The released config.json files (Mixtral-8x7B-v0.1, Qwen3-30B-A3B), sizes replaced below.
MIXTRAL_8X7B = {"architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
                "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
                "max_position_embeddings": 32768, "model_type": "mixtral", "num_attention_heads": 32,
                "num_experts_per_tok": 2, "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8,
                "output_router_logits": False, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0,
                "router_aux_loss_coef": 0.02, "sliding_window": None, "tie_word_embeddings": False,
                "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 32000}
QWEN3_30B_A3B = {"architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
                 "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
                 "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144,
                 "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [],
                 "model_type": "qwen3_moe", "moe_intermediate_size": 768, "norm_topk_prob": True,
                 "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48,
                 "num_key_value_heads": 4, "output_router_logits": False, "rms_norm_eps": 1e-06, "rope_scaling": None,
                 "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
                 "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
                 "use_sliding_window": False, "vocab_size": 151936}
MIXTRAL = {**MIXTRAL_8X7B, **SMALL, "intermediate_size": 32}
# head_dim = hidden_size / heads (the released 128 vs 2048 / 32 becomes model.head_dim, see below), 8
# experts of which 4 chosen; decoder_sparse_step 2 makes block 0 dense (intermediate_size) and block 1 MoE.
QWEN3_MOE = {**QWEN3_30B_A3B, **SMALL, "head_dim": 16, "intermediate_size": 96, "moe_intermediate_size": 32,
             "num_experts": 8, "num_experts_per_tok": 4}


def tokens(n: int = 24) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, n), generator=torch.Generator().manual_seed(1))


def hf_model(cfg: dict, tmp_path, stacked: bool = False):
    """A random float32 HF model saved with ``cfg`` as its config.json: by save_pretrained (the Hub's per-expert
    layout) or, ``stacked``, as its state dict is in memory (transformers 5's gate_up_proj / down_proj)."""
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(d)).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)
            elif name.endswith("gate.weight"):  # routers far from uniform: a wrong expert order shows
                p.normal_(0.0, 0.5)
    if stacked:
        sd = model.state_dict()
        assert any(k.endswith("experts.gate_up_proj") for k in sd)
        save_file({k: v.contiguous() for k, v in sd.items()}, str(d / "model.safetensors"))
    else:
        model.save_pretrained(d)
        (d / "config.json").write_text(json.dumps(cfg))
    return model.eval(), d


@pytest.mark.parametrize("name,cfg,stacked,expect", [
    ("mixtral", MIXTRAL, False, dict(arch="llama", moe_every=1, n_experts=8, top_k=2, expert_ffn_dim=32,
                                     n_shared_experts=0, aux_loss_weight=0.02, moe_norm_topk=True)),
    ("mixtral-stacked", MIXTRAL, True, dict(arch="llama", moe_every=1)),
    ("qwen3-moe", QWEN3_MOE, False, dict(arch="qwen3", moe_every=1, n_experts=8, top_k=4, expert_ffn_dim=32,
                                         moe_norm_topk=True)),
    ("qwen3-moe-dense-block", {**QWEN3_MOE, "decoder_sparse_step": 2}, True,
     dict(arch="qwen3", moe_every=2, ffn_dim=96)),
    # Qwen3MoeConfig's default (issue 49): the chosen experts weighted by their softmax probabilities as they are
    ("qwen3-moe-no-topk-norm", {**QWEN3_MOE, "norm_topk_prob": False}, False,
     dict(arch="qwen3", moe_every=1, moe_norm_topk=False)),
    ("qwen3-moe-default-topk-norm", {k: v for k, v in QWEN3_MOE.items() if k != "norm_topk_prob"}, True,
     dict(arch="qwen3", moe_norm_topk=False)),
])
def test_hf_moe_imports_and_exports_with_equal_logits(tmp_path, name, cfg, stacked, expect):
    ref, hf_dir = hf_model(cfg, tmp_path, stacked)
    with torch.no_grad():
        expected = ref(tokens()).logits

    from_hf(hf_dir, tmp_path / "run")
    model, run_cfg = megaloom_from_run(tmp_path / "run")
    for key, value in expect.items():
        assert getattr(run_cfg.model, key) == value, key
    assert (run_cfg.model.aux_free_bias_rate, run_cfg.model.capacity_factor) == (0.0, 0.0)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens()), expected, atol=ATOL, rtol=0)

    to_hf(tmp_path / "run", tmp_path / "back", show_progress=False)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert type(back) is type(ref)
    for k, v in ref.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    with torch.no_grad():
        torch.testing.assert_close(back(tokens()).logits, expected, atol=ATOL, rtol=0)


# the saved runs' model (each test adds its overrides)
RUN_KEYS = [f"model.vocab_size={VOCAB}", "model.d_model=64", "model.n_layers=2", "model.n_heads=4",
            "model.n_kv_heads=2", "model.ffn_dim=96", "model.expert_ffn_dim=32", "model.n_experts=4",
            "model.max_seq_len=64", "model.tie_embeddings=false", "train.seq_len=32"]


def saved_run(tmp_path, *overrides: str, steps: int = 0):
    """A run directory holding a checkpoint of a model of ``overrides`` after ``steps`` AdamW steps."""
    return saved_run_of(tmp_path, [*RUN_KEYS, *overrides], tokens(32), steps)


@pytest.mark.parametrize("norm", [True, False])
def test_trained_qwen3_moe_run_round_trips(tmp_path, norm):
    """megaloom -> Qwen3MoeForCausalLM (equal logits) -> megaloom (the same tensors), a dense block included; with
    and without the chosen weights renormalised (model.moe_norm_topk <-> norm_topk_prob)."""
    run, model = saved_run(tmp_path, "model.preset=qwen3-tiny", "model.moe_every=2", "model.top_k=2",
                           "model.aux_free_bias_rate=0", f"model.moe_norm_topk={str(norm).lower()}", steps=2)
    to_hf(run, tmp_path / "hf", show_progress=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(hf) is transformers.Qwen3MoeForCausalLM and hf.config.norm_topk_prob is norm
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens()).logits, model(tokens()), atol=ATOL, rtol=0)
    from_hf(tmp_path / "hf", tmp_path / "run2")
    again, cfg = megaloom_from_run(tmp_path / "run2")
    assert (cfg.model.arch, cfg.model.moe_every, cfg.model.n_experts, cfg.model.top_k) == ("qwen3", 2, 4, 2)
    assert cfg.model.moe_norm_topk is norm
    for k, v in model.state_dict().items():
        assert torch.equal(again.state_dict()[k], v), k


@pytest.mark.parametrize("overrides,field", [
    (["model.preset=mixtral-tiny", "model.moe_every=1"], "model.n_shared_experts"),  # the preset has one
    (["model.moe_every=2"], "model.moe_every"),  # Mixtral: every block
    (["model.moe_every=1", "model.router_score=sigmoid"], "model.router_score"),
    (["model.moe_every=1", "model.moe_norm_topk=false"], "model.moe_norm_topk"),  # Mixtral always renormalises
])
def test_moe_models_hf_cannot_express_are_refused_on_export(tmp_path, overrides, field):
    run, _ = saved_run(tmp_path, *overrides)
    with pytest.raises(ConversionError, match=field):
        to_hf(run, tmp_path / "out", show_progress=False)
    assert not (tmp_path / "out").exists()


def test_a_trained_selection_bias_is_refused_on_export(tmp_path):
    cfg = load_config(None, [f"model.vocab_size={VOCAB}", "model.d_model=64", "model.n_layers=1", "model.n_heads=4",
                             "model.moe_every=1", "model.n_experts=4", "model.max_seq_len=64", "train.seq_len=32"])
    model = Transformer(cfg.model)
    model.layers["0"].mlp.router.expert_bias[1] = 0.01  # what model.aux_free_bias_rate trains
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(cfg.to_yaml())
    save_checkpoint(run / "checkpoints", 1, model, None, {}, keep=1)
    with pytest.raises(ConversionError, match=r"expert_bias is not zero \(model\.aux_free_bias_rate"):
        to_hf(run, tmp_path / "out", show_progress=False)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("cfg,field", [
    ({**QWEN3_MOE, "mlp_only_layers": [0]}, "mlp_only_layers"),
    ({**QWEN3_MOE, "decoder_sparse_step": 0}, "decoder_sparse_step"),
    ({**MIXTRAL, "sliding_window": 4096}, "sliding_window"),
])
def test_unsupported_moe_configs_name_the_field(tmp_path, cfg, field):
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConversionError, match=field):
        from_hf(d, tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_the_released_qwen3_moe_shape_reads_its_head_dim():
    """Qwen3-30B-A3B's heads (128) are wider than 2048 / 32: model.head_dim, no longer a refusal."""
    from megaloom.convert.hf_config import model_settings

    s = model_settings(QWEN3_30B_A3B, "config.json")
    assert (s["arch"], s["d_model"], s["n_heads"], s["n_kv_heads"], s["head_dim"]) == ("qwen3", 2048, 32, 4, 128)
    assert (s["moe_every"], s["n_experts"], s["top_k"], s["expert_ffn_dim"]) == (1, 128, 8, 768)
