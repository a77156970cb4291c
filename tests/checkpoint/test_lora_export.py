"""LoRA from an imported HF model to transformers and PEFT, checked by logits: `convert --from-hf` -> `megaloom train
model.lora.rank=...` in the same run.dir (a new stage on the imported weights) -> `convert --to-hf` (adapters
merged) and `convert --to-peft` (PEFT's adapter directory, loaded by `peft` onto the original model)."""

from __future__ import annotations

import json

import pytest
import torch

from megaloom.convert import from_hf, to_hf
from megaloom.convert.errors import ConversionError
from tests.conftest import tiny_overrides

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore:.*has no tokenizer.json")

TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"


@pytest.fixture(scope="module")
def lora_run(small_corpus, tmp_path_factory) -> dict:
    """An HF Llama, imported, then 2 LoRA steps in the run.dir of the import (the adapters alone move)."""
    from megaloom.config import load_config
    from megaloom.training.trainer import Trainer

    root = tmp_path_factory.mktemp("lora-export")
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
        vocab_size=512, max_position_embeddings=128, rope_theta=500.0, tie_word_embeddings=False)).eval()
    hf.save_pretrained(root / "hf")
    run = root / "run"
    from_hf(root / "hf", run)
    keys = [o for o in tiny_overrides(small_corpus, run) if not o.startswith("model.")]
    trainer = Trainer(load_config(run / "config.yaml", [*keys, "train.steps=2", "train.lr=3e-2",
                                                        "model.lora.rank=4", "model.lora.alpha=16",
                                                        f"model.lora.targets={TARGETS}"])).build()
    assert trainer.step == 0 and trainer.resumed_step == 0  # the imported step 0: a new stage, adapters fresh
    trainer.fit()
    from megaloom.generate import load_for_generation

    model, _ = load_for_generation(run, torch.device("cpu"))  # the run's newest checkpoint, adapters included
    x = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, base = model.eval()(x), hf(x).logits
    assert (ours - base).abs().max() > 1e-2  # the adapters trained: otherwise nothing below would be tested
    return dict(root=root, run=run, x=x, logits=ours, hf=hf)


def test_hf_export_merges_the_adapters(lora_run) -> None:
    out = to_hf(lora_run["run"], lora_run["root"] / "merged", show_progress=False)
    merged = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert not any("lora" in k for k in merged.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(merged(lora_run["x"]).logits, lora_run["logits"], atol=1e-4, rtol=0)


def test_peft_loads_the_adapter_onto_the_base_model(lora_run) -> None:
    from megaloom.cli import main

    out = lora_run["root"] / "adapter"
    assert main(["convert", "--to-peft", str(lora_run["run"]), str(out)]) == 0
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 4, 16.0)
    assert sorted(config["target_modules"]) == sorted(TARGETS.split(","))
    from safetensors import safe_open

    with safe_open(str(out / "adapter_model.safetensors"), "pt") as f:
        names = set(f.keys())  # noqa: SIM118 (safe_open is not a mapping)
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in names and len(names) == 2 * 7 * 2
    peft = pytest.importorskip("peft")
    base = transformers.AutoModelForCausalLM.from_pretrained(lora_run["root"] / "hf").eval()
    model = peft.PeftModel.from_pretrained(base, out).eval()
    with torch.no_grad():
        torch.testing.assert_close(model(lora_run["x"]).logits, lora_run["logits"], atol=1e-4, rtol=0)


def test_peft_export_refuses_what_it_cannot_name(lora_run, tmp_path) -> None:
    from megaloom.convert.peft import to_peft

    with pytest.raises(ConversionError, match=r"model.lora.rank=0.*--to-hf"):
        to_peft(_checkpoint(tmp_path / "plain", "llama", 0), tmp_path / "x")
    with pytest.raises(ConversionError, match=r"layers.0.attn.\w_proj: GPT2LMHeadModel stores this linear fused"):
        to_peft(_checkpoint(tmp_path / "gpt2", "gpt2", 4), tmp_path / "y")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "adapter_config.json").write_text("{}")
    with pytest.raises(ConversionError, match="already holds adapter_config.json"):
        to_peft(lora_run["run"], tmp_path / "taken")


def _checkpoint(run, arch: str, rank: int):
    """A run directory with one checkpoint of a tiny ``arch`` model (LoRA rank ``rank``): no training needed."""
    from megaloom.checkpoint import save_checkpoint
    from megaloom.config import load_config
    from megaloom.models.registry import get_family

    cfg = load_config(None, [f"model.arch={arch}", "model.vocab_size=128", "model.d_model=64", "model.n_layers=2",
                             "model.n_heads=4", "model.n_kv_heads=4", "model.max_seq_len=64", "train.seq_len=32",
                             f"run.dir={run}", f"model.lora.rank={rank}"])
    run.mkdir()
    (run / "config.yaml").write_text(cfg.to_yaml())
    return save_checkpoint(run / "checkpoints", 1, get_family(arch).build(cfg.model), None,
                           {"model": cfg.model.__dict__}, keep=1)
