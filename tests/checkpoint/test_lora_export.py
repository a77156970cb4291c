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


def test_a_peft_adapter_imports_with_its_base_and_computes_what_peft_does(lora_run, small_corpus, tmp_path) -> None:
    """`convert --from-hf HF --peft ADAPTER`: a LoRA adapter made by `peft` (non-zero B, three target kinds, its own
    r / alpha / dropout) on the HF model imports as a LoRA run whose logits equal PeftModel's, whose fine-tuning
    starts from the adapter, and whose --to-peft export gives back the same tensors."""
    peft = pytest.importorskip("peft")
    from safetensors.torch import load_file

    from megaloom.checkpoint import load_newest
    from megaloom.cli import main
    from megaloom.config import load_config
    from megaloom.convert.peft import to_peft
    from megaloom.models.registry import get_family
    from megaloom.training.trainer import Trainer

    base = transformers.AutoModelForCausalLM.from_pretrained(lora_run["root"] / "hf").eval()
    torch.manual_seed(3)
    adapted = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=12, lora_dropout=0.05, init_lora_weights=False,
                                                        target_modules=["q_proj", "v_proj", "down_proj"])).eval()
    adapted.save_pretrained(tmp_path / "adapter")
    run = tmp_path / "run"
    assert main(["convert", "--from-hf", str(lora_run["root"] / "hf"), str(run), "--peft",
                 str(tmp_path / "adapter")]) == 0
    cfg = load_config(run / "config.yaml")
    assert (cfg.model.lora.rank, cfg.model.lora.alpha, cfg.model.lora.dropout) == (4, 12.0, 0.05)
    assert cfg.model.lora.targets == ["down_proj", "q_proj", "v_proj"]
    model = get_family(cfg.model.arch).build(cfg.model)
    assert load_newest(run / "checkpoints", model, None, model_cfg=cfg.model.__dict__) is not None
    with torch.no_grad():
        want = adapted(lora_run["x"]).logits
        assert (want - lora_run["hf"](lora_run["x"]).logits).abs().max() > 1e-2  # the adapter matters
        torch.testing.assert_close(model.eval()(lora_run["x"]), want, atol=1e-4, rtol=0)
    # the export gives the very tensors back
    to_peft(run, tmp_path / "again")
    got, orig = load_file(str(tmp_path / "again" / "adapter_model.safetensors")), \
        load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert sorted(got) == sorted(orig) and all(torch.equal(got[k], orig[k]) for k in orig)
    # fine-tuning the imported run starts from the adapter (not fresh zeros)
    keys = [o for o in tiny_overrides(small_corpus, run) if not o.startswith("model.")]
    trainer = Trainer(load_config(run / "config.yaml", [*keys, "train.steps=1"])).build()
    b = dict(trainer.model.named_parameters())["layers.0.attn.q_proj.lora_B.weight"]
    assert trainer.step == 0 and b.abs().max() > 0 and b.requires_grad


def test_peft_import_refuses_what_megaloom_cannot_compute(lora_run, tmp_path) -> None:
    peft = pytest.importorskip("peft")

    base = transformers.AutoModelForCausalLM.from_pretrained(lora_run["root"] / "hf").eval()
    peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj"], use_rslora=True)).save_pretrained(
        tmp_path / "rs")
    with pytest.raises(ConversionError, match=r"use_rslora=True is not supported .*merge_and_unload"):
        from_hf(lora_run["root"] / "hf", tmp_path / "run", peft_dir=tmp_path / "rs")
    with pytest.raises(ConversionError, match="not a PEFT adapter directory"):
        from_hf(lora_run["root"] / "hf", tmp_path / "run2", peft_dir=tmp_path)
