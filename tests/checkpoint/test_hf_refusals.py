"""What the HF interchange refuses, and that each error names the setting (no transformers needed)."""

from __future__ import annotations

import json

import pytest
import torch

from megaloom.checkpoint import save_checkpoint
from megaloom.config import load_config
from megaloom.convert import ConversionError, from_hf, to_hf
from megaloom.models import Transformer

pytestmark = pytest.mark.filterwarnings("ignore:.*has no tokenizer.json")
LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 32, "intermediate_size": 64,
         "num_attention_heads": 2, "num_key_value_heads": 2, "num_hidden_layers": 1, "vocab_size": 64,
         "max_position_embeddings": 32}
GPT2 = {"model_type": "gpt2", "n_embd": 32, "n_layer": 1, "n_head": 2, "n_positions": 32, "vocab_size": 64}


def hf_dir(tmp_path, cfg: dict):
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize("cfg,field", [
    ({**LLAMA, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling"),
    ({**LLAMA, "rope_parameters": {"rope_type": "dynamic", "rope_theta": 5e5, "factor": 2.0}},
     "rope_parameters.rope_type"),
    ({**LLAMA, "rope_scaling": {"rope_type": "llama3", "original_max_position_embeddings": 16}}, "factor"),
    ({**LLAMA, "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 1.0}},
     "mscale"),  # DeepSeek's YaRN variant
    ({**LLAMA, "rope_scaling": {"rope_type": "yarn", "factor": 4.0},  # two layouts that disagree
      "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}, "rope_scaling"),
    ({**LLAMA, "attention_bias": True}, "attention_bias"),
    ({**LLAMA, "mlp_bias": True}, "mlp_bias"),
    ({**LLAMA, "hidden_act": "gelu"}, "hidden_act"),
    ({**GPT2, "activation_function": "relu"}, "activation_function"),
    ({**GPT2, "scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
    ({**LLAMA, "model_type": "mistral"}, "model_type"),
    ({k: v for k, v in LLAMA.items() if k != "hidden_size"}, "hidden_size"),
])
def test_unsupported_hf_configs_name_the_field(tmp_path, cfg, field):
    with pytest.raises(ConversionError, match=field.replace(".", r"\.")):
        from_hf(hf_dir(tmp_path, cfg), tmp_path / "run")
    assert not (tmp_path / "run").exists()  # nothing half-written


def test_pickled_weights_are_not_read(tmp_path):
    d = hf_dir(tmp_path, LLAMA)
    (d / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(ConversionError, match="safe_serialization"):
        from_hf(d, tmp_path / "run")


def saved_run(tmp_path, *overrides: str):
    cfg = load_config(None, ["model.vocab_size=64", "model.d_model=32", "model.n_layers=1", "model.n_heads=2",
                             "model.max_seq_len=32", "train.seq_len=32", *overrides])
    model = Transformer(cfg.model)
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(cfg.to_yaml())
    save_checkpoint(run / "checkpoints", 1, model, torch.optim.AdamW(model.parameters()), {}, keep=1)
    return run


@pytest.mark.parametrize("overrides,field", [(["model.parallel_block=true"], "model.parallel_block"),
                                             (["model.sliding_window=8"], "model.sliding_window"),
                                             # a family without an MoE mapping (llama's and qwen3's have one)
                                             (["model.preset=tiny-gpt2", "model.moe_every=1"], "model.moe_every"),
                                             (["model.qkv_bias=true"], "model.qkv_bias"),  # Llama's is on o too
                                             # GPT-2's and BERT's heads are always hidden / heads wide
                                             (["model.preset=tiny-gpt2", "model.head_dim=32"], "model.head_dim"),
                                             (["model.preset=bert-tiny", "model.head_dim=8"], "model.head_dim")])
def test_models_hf_cannot_express_are_refused(tmp_path, overrides, field):
    run = saved_run(tmp_path, *overrides)
    with pytest.raises(ConversionError, match=field):
        to_hf(run, tmp_path / "out", show_progress=False)
    assert not (tmp_path / "out").exists()  # refused before anything is written


def test_a_family_without_hf_mapping_is_refused_by_name(tmp_path, monkeypatch):
    import dataclasses

    from megaloom.models import registry

    run = saved_run(tmp_path)
    monkeypatch.setitem(registry.FAMILIES, "llama", dataclasses.replace(registry.FAMILIES["llama"], hf=None))
    with pytest.raises(ConversionError, match="model.arch='llama' has no Hugging Face conversion"):
        to_hf(run, tmp_path / "out", show_progress=False)
    with pytest.raises(ConversionError, match="model_type='llama'.*cannot be imported"):
        from_hf(hf_dir(tmp_path, LLAMA), tmp_path / "run2")


def test_export_never_overwrites_and_needs_a_checkpoint(tmp_path):
    run = saved_run(tmp_path)
    to_hf(run, tmp_path / "out", show_progress=False)
    with pytest.raises(ConversionError, match="already holds config.json"):
        to_hf(run, tmp_path / "out", show_progress=False)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConversionError, match="no checkpoints"):
        to_hf(tmp_path / "empty", tmp_path / "out2", show_progress=False)


def test_convert_command_round_trip(tmp_path, capsys):
    import argparse

    from megaloom.convert.cli import add_convert_parser

    parser = argparse.ArgumentParser(prog="megaloom")
    add_convert_parser(parser.add_subparsers(dest="command", required=True))
    run = saved_run(tmp_path, "model.tie_embeddings=false")
    args = parser.parse_args(["convert", "--to-hf", str(run), str(tmp_path / "hf"), "--no-progress"])
    assert args.fn(args) == 0
    args = parser.parse_args(["convert", "--from-hf", str(tmp_path / "hf"), str(tmp_path / "run2")])
    assert args.fn(args) == 0
    assert "megaloom train --config" in capsys.readouterr().out
    ckpt = tmp_path / "run2" / "checkpoints" / "step_00000000"
    cfg = load_config(tmp_path / "run2" / "config.yaml")
    model = Transformer(cfg.model)
    from megaloom.checkpoint import load_checkpoint

    load_checkpoint(ckpt, model, None, model_cfg=cfg.model.__dict__)
    original = Transformer(cfg.model)
    load_checkpoint(run / "checkpoints" / "step_00000001", original, None)
    for k, v in original.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k


def test_checkpoint_recorded_before_the_rope_scaling_keys_exports_from_state_json(tmp_path):
    """A checkpoint without its run's config.yaml is described by state.json's model section; one written before
    the model.rope_* scaling keys existed lacks them and still exports (as plain RoPE, what it trained with)."""
    cfg = load_config(None, ["model.vocab_size=64", "model.d_model=32", "model.n_layers=1", "model.n_heads=2",
                             "model.max_seq_len=32", "train.seq_len=32"])
    old = {k: v for k, v in cfg.model.__dict__.items() if not k.startswith("rope_") or k == "rope_theta"}
    ckpt = save_checkpoint(tmp_path / "run" / "checkpoints", 1, Transformer(cfg.model), None, {"model": old}, keep=1)
    to_hf(ckpt, tmp_path / "out", show_progress=False)
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["rope_parameters"]["rope_type"] == "default" and "rope_scaling" not in written
