"""DeepSeek-V3 interchange: DeepseekV3ForCausalLM <-> llama with model.attention=mla (latent attention, DeepSeek's
router, dense first blocks). Built locally from the released config.json (deepseek-ai/DeepSeek-V3) with the sizes
shrunk, checked by logits against transformers' eager attention both ways; a trained megaloom run round-trips; and
what neither side can express is refused by name."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DeepseekV3ForCausalLM"):
    pytest.skip("this transformers has no DeepseekV3ForCausalLM", allow_module_level=True)

from megaloom.checkpoint import save_checkpoint  # noqa: E402
from megaloom.config import load_config  # noqa: E402
from megaloom.convert import ConversionError, from_hf, to_hf  # noqa: E402
from tests.checkpoint.hf_common import megaloom_from_run  # noqa: E402
from tests.checkpoint.hf_common import saved_run as saved_run_of  # noqa: E402

ATOL = 1e-4
VOCAB = 128
pytestmark = pytest.mark.filterwarnings("ignore:.*has no tokenizer.json")

# The released config.json of deepseek-ai/DeepSeek-V3, without auto_map and its fp8 quantization_config.
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3,
    "hidden_act": "silu", "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v3", "moe_intermediate_size": 2048,
    "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
    "use_cache": True, "v_head_dim": 128, "vocab_size": 129280}
# 3 blocks, the first dense; 8 experts in 4 groups, 2 groups and 2 experts chosen; v (12) narrower than q/k (16 + 8)
SMALL = {**DEEPSEEK_V3, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3, "first_k_dense_replace": 1,
         "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 24, "kv_lora_rank": 32,
         "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 12, "n_routed_experts": 8, "n_group": 4,
         "topk_group": 2, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "vocab_size": VOCAB}
# DeepSeek-V2-Lite's attention (no query compression), plain RoPE, every block dense
DENSE = {**SMALL, "q_lora_rank": None, "first_k_dense_replace": 3, "rope_scaling": None}


def tokens(n: int = 24) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, n), generator=torch.Generator().manual_seed(1))


# the saved runs' model (each test adds its overrides)
RUN_KEYS = [f"model.vocab_size={VOCAB}", "model.d_model=64", "model.n_layers=2", "model.n_heads=4",
            "model.ffn_dim=96", "model.expert_ffn_dim=32", "model.n_experts=8", "model.max_seq_len=64",
            "model.tie_embeddings=false", "train.seq_len=32"]


def saved_run(tmp_path, *overrides: str, steps: int = 0):
    """A run directory holding a checkpoint of a model of ``overrides`` after ``steps`` AdamW steps."""
    return saved_run_of(tmp_path, [*RUN_KEYS, *overrides], tokens(32), steps)


def hf_model(cfg: dict, tmp_path):
    """A random float32 DeepseekV3ForCausalLM with ``cfg`` as its config.json, saved by save_pretrained."""
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    torch.manual_seed(0)
    config = transformers.AutoConfig.from_pretrained(d)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)
            elif name.endswith("gate.weight"):  # routers far from uniform: a wrong expert or group order shows
                p.normal_(0.0, 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # a trained selection bias: it must choose the same experts
                b.normal_(0.0, 0.2)
    model.save_pretrained(d)
    (d / "config.json").write_text(json.dumps(cfg))
    return model.eval(), d


def hf_from(d):
    return transformers.AutoModelForCausalLM.from_pretrained(d, attn_implementation="eager").float().eval()


@pytest.mark.parametrize("name,cfg,expect", [
    ("deepseek-v3", SMALL, dict(attention="mla", q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16,
                                qk_rope_head_dim=8, v_head_dim=12, moe_every=1, first_dense_layers=1, n_experts=8,
                                top_k=2, n_shared_experts=1, expert_ffn_dim=16, router_score="sigmoid",
                                n_expert_groups=4, topk_groups=2, routed_scaling_factor=2.5, rope_scaling="yarn",
                                rope_factor=40.0, rope_original_max_len=4096, rope_mscale_all_dim=1.0,
                                rope_attention_factor=1.0, max_seq_len=163840)),
    ("dense", DENSE, dict(attention="mla", q_lora_rank=0, moe_every=0, ffn_dim=96, rope_scaling="none")),
    # norm_topk_prob=false (issue 49): the chosen experts weighted by their sigmoid scores x routed_scaling_factor
    ("no-topk-norm", {**SMALL, "norm_topk_prob": False}, dict(moe_norm_topk=False, routed_scaling_factor=2.5)),
])
def test_hf_deepseek_v3_imports_and_exports_with_equal_logits(tmp_path, name, cfg, expect):
    ref, hf_dir = hf_model(cfg, tmp_path)
    with torch.no_grad():
        expected = ref(tokens()).logits

    from_hf(hf_dir, tmp_path / "run")
    model, run_cfg = megaloom_from_run(tmp_path / "run")
    for key, value in expect.items():
        assert getattr(run_cfg.model, key) == value, key
    with torch.no_grad():
        torch.testing.assert_close(model(tokens()), expected, atol=ATOL, rtol=0)

    to_hf(tmp_path / "run", tmp_path / "back", show_progress=False)
    back = hf_from(tmp_path / "back")
    assert type(back) is type(ref) and back.config.rope_interleave
    for k, v in ref.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k  # the interleaved rope rows restored exactly
    with torch.no_grad():
        torch.testing.assert_close(back(tokens()).logits, expected, atol=ATOL, rtol=0)


def test_mtp_layers_of_a_checkpoint_are_skipped(tmp_path):
    """A checkpoint with its multi-token-prediction layer (model.layers.<num_hidden_layers>.*, as released) imports
    the main model; transformers skips the layer too."""
    from safetensors.torch import load_file, save_file

    ref, hf_dir = hf_model(DENSE, tmp_path)
    tensors = load_file(hf_dir / "model.safetensors")
    tensors["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)
    tensors["model.layers.3.enorm.weight"] = torch.ones(64)
    save_file(tensors, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
    from_hf(hf_dir, tmp_path / "run")
    model, _ = megaloom_from_run(tmp_path / "run")
    with torch.no_grad():
        torch.testing.assert_close(model(tokens()), ref(tokens()).logits, atol=ATOL, rtol=0)


def test_trained_deepseek_v3_tiny_run_round_trips(tmp_path):
    """megaloom (the deepseek-v3-tiny shape, trained off its init: routers, selection bias) -> DeepseekV3ForCausalLM
    (equal logits) -> megaloom (the same tensors)."""
    run, model = saved_run(tmp_path, "model.preset=deepseek-v3-tiny", "model.n_kv_heads=0", "model.n_layers=2",
                           "model.q_lora_rank=16", "model.n_experts=8", "model.n_expert_groups=4",
                           "model.topk_groups=2", "model.top_k=2", steps=2)
    for layer in model.layers.values():
        if hasattr(layer.mlp, "router"):
            layer.mlp.router.expert_bias.normal_(0.0, 0.1)  # what aux-loss-free balancing trains
    save_checkpoint(run / "checkpoints", 3, model, None, {}, keep=1)
    to_hf(run, tmp_path / "hf", show_progress=False)
    hf = hf_from(tmp_path / "hf")
    assert type(hf) is transformers.DeepseekV3ForCausalLM
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens()).logits, model(tokens()), atol=ATOL, rtol=0)
    from_hf(tmp_path / "hf", tmp_path / "run2")
    again, cfg = megaloom_from_run(tmp_path / "run2")
    assert (cfg.model.attention, cfg.model.first_dense_layers, cfg.model.n_expert_groups) == ("mla", 1, 4)
    for k, v in model.state_dict().items():
        assert torch.equal(again.state_dict()[k], v), k


def test_mtp_modules_export_in_deepseeks_layout(tmp_path):
    """A run with multi-token prediction writes each module as DeepSeek's layer num_hidden_layers + k (transformers
    ignores it: the logits are the main model's); import reads the main model (model.mtp_depth=0)."""
    from safetensors import safe_open

    run, model = saved_run(tmp_path, "model.preset=deepseek-v3-tiny", "model.n_kv_heads=0", "model.n_layers=2",
                           "model.n_experts=8", "model.mtp_depth=1", steps=1)
    to_hf(run, tmp_path / "hf", show_progress=False)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1
    with safe_open(tmp_path / "hf" / "model.safetensors", "pt") as f:
        names = set(f.keys())
        assert torch.equal(f.get_tensor("model.layers.2.eh_proj.weight"), model.mtp["0"].eh_proj.weight)
    assert {"model.layers.2.enorm.weight", "model.layers.2.hnorm.weight", "model.layers.2.shared_head.norm.weight",
            "model.layers.2.embed_tokens.weight", "model.layers.2.shared_head.head.weight",
            "model.layers.2.mlp.gate.e_score_correction_bias", "model.layers.2.self_attn.kv_b_proj.weight"} <= names
    hf = hf_from(tmp_path / "hf")
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens()).logits, model(tokens()), atol=ATOL, rtol=0)
    from_hf(tmp_path / "hf", tmp_path / "run2")
    again, cfg = megaloom_from_run(tmp_path / "run2")
    assert cfg.model.mtp_depth == 0
    for k, v in again.state_dict().items():
        assert torch.equal(v, model.state_dict()[k]), k


@pytest.mark.parametrize("cfg,field", [
    ({**SMALL, "num_key_value_heads": 2}, "num_key_value_heads"),
    ({**SMALL, "rope_interleave": False}, "rope_interleave"),
    ({**SMALL, "attention_bias": True}, "attention_bias"),
])
def test_unsupported_deepseek_configs_name_the_field(tmp_path, cfg, field):
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConversionError, match=field):
        from_hf(d, tmp_path / "run")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("overrides,field", [
    (["model.moe_every=2"], "model.moe_every"),
    (["model.moe_every=1", "model.router_score=softmax"], "model.router_score"),
    (["model.moe_every=1", "model.router_score=sigmoid", "model.n_shared_experts=0"], "model.n_shared_experts"),
])
def test_mla_models_deepseek_cannot_express_are_refused_on_export(tmp_path, overrides, field):
    run, _ = saved_run(tmp_path, "model.preset=deepseek-v3-tiny", "model.n_kv_heads=0", *overrides)
    with pytest.raises(ConversionError, match=field):
        to_hf(run, tmp_path / "out", show_progress=False)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("overrides,field", [
    (["model.preset=mixtral-tiny", "model.n_shared_experts=0", "model.first_dense_layers=1"],
     "model.first_dense_layers"),
    (["model.preset=mixtral-tiny", "model.n_shared_experts=0", "model.routed_scaling_factor=2.5"],
     "model.routed_scaling_factor"),
])
def test_deepseek_routing_is_refused_by_mixtral_export(tmp_path, overrides, field):
    run, _ = saved_run(tmp_path, "model.moe_every=1", *overrides)
    with pytest.raises(ConversionError, match=field):
        to_hf(run, tmp_path / "out", show_progress=False)


def test_latent_attention_needs_a_family_with_a_deepseek_mapping(tmp_path):
    from megaloom.convert.hf_config import hf_mapping

    cfg = load_config(None, ["model.arch=llava", "model.attention=mla", "model.n_kv_heads=0", "model.kv_lora_rank=8",
                             "model.qk_nope_head_dim=8", "model.qk_rope_head_dim=8", "model.v_head_dim=8"])
    with pytest.raises(ConversionError, match="model.attention=mla"):
        hf_mapping(cfg.model)
