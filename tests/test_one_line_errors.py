"""Faults that printed a raw traceback now say what is wrong in one line (issue 19, fault 10): YAML syntax and tag
errors name the file; checkpoint/model mismatches (moe_every, max_seq_len, anything DCP refuses), a refused RNG
pickle and a damaged model.safetensors are CheckpointError/ConversionError lines."""

from __future__ import annotations

import json
import pickle

import pytest
import torch

from megaloom.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from megaloom.checkpoint.store import check_compatible
from megaloom.cli import main
from megaloom.config import ConfigError, load_config
from megaloom.convert import ConversionError, from_hf
from megaloom.models import Transformer
from megaloom.train import load_run_config
from tests.checkpoint.test_store import make


@pytest.mark.parametrize("text,fragment", [
    ("train:\n  steps: [1\n", "line 3, column 1"),
    ("train: !!python/object/apply:os.system ['echo hi']\n", "Python tags are refused"),
    ("train:\n\tsteps: 3\n", "line 2"),
])
def test_bad_yaml_names_the_file_in_one_line(tmp_path, capsys, text, fragment):
    f = tmp_path / "run.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=fragment) as err:
        load_config(f)
    assert str(f) in str(err.value) and "\n" not in str(err.value)
    assert main(["train", "--config", str(f)]) == 2
    line = capsys.readouterr().err
    assert line.startswith("megaloom: error: --config") and line.count("\n") == 1 and "Traceback" not in line


def test_a_damaged_run_config_yaml_is_one_line(tmp_path):
    (tmp_path / "config.yaml").write_text("model: {preset: tiny\n")
    with pytest.raises(ConfigError, match="config.yaml: not valid YAML"):
        load_run_config(tmp_path)


@pytest.mark.parametrize("key,saved,current,arch", [
    ("moe_every", 0, 1, "llama"),
    ("n_experts", 8, 4, "llama"),
    ("max_seq_len", 1024, 512, "gpt2"),
])
def test_shape_settings_are_compared_before_loading(key, saved, current, arch):
    base = {"arch": arch, "n_layers": 2, "moe_every": 1 if key == "n_experts" else 0, "max_seq_len": 1024}
    with pytest.raises(CheckpointError, match=f"incompatible.*model.{key}: checkpoint {saved} vs config {current}"):
        check_compatible({**base, key: saved}, {**base, key: current})


def test_rope_models_load_at_any_max_seq_len():
    base = {"arch": "llama", "n_layers": 2, "max_seq_len": 1024}
    check_compatible(base, {**base, "max_seq_len": 4096})  # RoPE tables are recomputed: no tensor changes shape


def test_a_mismatch_only_dcp_sees_is_one_checkpoint_error(tmp_path):
    cfg, m, opt = make()
    path = save_checkpoint(tmp_path / "c", 1, m, opt, {}, keep=3)
    other = load_config(None, ["model.vocab_size=64", "model.d_model=32", "model.n_layers=1", "model.n_heads=2",
                               "model.ffn_dim=96", "model.max_seq_len=16", "train.seq_len=16"])
    m2 = Transformer(other.model)
    with pytest.raises(CheckpointError, match="incompatible with this model: Size mismatch") as err:
        load_checkpoint(path, m2, torch.optim.AdamW(m2.parameters()))  # no model_cfg: nothing compared first
    assert "Traceback" not in str(err.value)


class _Payload:
    def __reduce__(self):
        return (print, ("unpickled!",))


def test_a_refused_rng_pickle_is_a_checkpoint_error(tmp_path, capsys):
    cfg, m, opt = make()
    path = save_checkpoint(tmp_path / "c", 1, m, opt, {}, keep=3)
    rng = path / "rng_rank0.pt"
    torch.save({"torch": _Payload()}, rng)  # a forged RNG file, the manifest rehashed to match
    manifest = json.loads((path / "manifest.json").read_text())
    import hashlib
    manifest[rng.name] = {"sha256": hashlib.sha256(rng.read_bytes()).hexdigest(), "bytes": rng.stat().st_size}
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="rng_rank0.pt is not a tensor-only RNG state") as err:
        load_checkpoint(path, m, opt)
    assert isinstance(err.value.__cause__, pickle.UnpicklingError)
    assert "unpickled!" not in capsys.readouterr().out


LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 32, "intermediate_size": 64,
         "num_attention_heads": 2, "num_key_value_heads": 2, "num_hidden_layers": 1, "vocab_size": 64,
         "max_position_embeddings": 32}


@pytest.mark.filterwarnings("ignore:.*has no tokenizer.json")
@pytest.mark.parametrize("damage", ["truncate", "header"])
def test_a_damaged_model_safetensors_is_one_conversion_error(tmp_path, damage):
    from safetensors.torch import save_file

    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(LLAMA))
    save_file({"model.embed_tokens.weight": torch.zeros(64, 32)}, str(d / "model.safetensors"))
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[:-100] if damage == "truncate" else b"\xff" * 8 + data[8:])
    with pytest.raises(ConversionError, match="model.safetensors: not a readable safetensors file"):
        from_hf(d, tmp_path / "run")
