"""Hugging Face interchange, checked by logits: HF -> megaloom -> HF and megaloom -> HF, Llama and GPT-2."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

transformers = pytest.importorskip("transformers")

from megaloom.checkpoint import find_checkpoints, load_checkpoint, save_checkpoint  # noqa: E402
from megaloom.config import load_config  # noqa: E402
from megaloom.convert import from_hf, to_hf  # noqa: E402
from megaloom.models import Transformer  # noqa: E402

ATOL = 1e-5
VOCAB = 128
pytestmark = pytest.mark.filterwarnings("ignore:.*has no tokenizer.json")


def hf_model(arch: str, tied: bool, head_dim: int | None = None):
    """A tiny randomly initialised HF model; norms are randomised too, so a swapped norm would show. ``head_dim``
    (llama): heads of another width than hidden_size / num_attention_heads."""
    torch.manual_seed(0)
    if arch == "llama":
        cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                                       num_key_value_heads=2, num_hidden_layers=2, vocab_size=VOCAB,
                                       max_position_embeddings=64, rope_theta=500.0, rms_norm_eps=1e-5,
                                       tie_word_embeddings=tied, head_dim=head_dim)
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=64, vocab_size=VOCAB,
                                      n_inner=80, tie_word_embeddings=tied, bos_token_id=0, eos_token_id=0)
        model = transformers.GPT2LMHeadModel(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or ".ln_" in name or "bias" in name:
                p.normal_(1.0 if name.endswith("weight") else 0.0, 0.1)
    return model.eval()


def hf_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens).logits


def megaloom_from_run(run_dir):
    cfg = load_config(run_dir / "config.yaml")  # what `megaloom train --config run/config.yaml` does
    model = Transformer(cfg.model)
    state = load_checkpoint(find_checkpoints(run_dir / "checkpoints")[0], model, None,
                            model_cfg=cfg.model.__dict__)
    return model.eval(), state


def tokens(n: int = 24) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, n), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("arch,tied,head_dim", [("llama", False, None), ("llama", True, None), ("gpt2", True, None),
                                               ("llama", False, 24)])  # model.head_dim: 4 heads of 24 over 64
def test_hf_to_megaloom_to_hf_keeps_logits(tmp_path, arch, tied, head_dim):
    ref = hf_model(arch, tied, head_dim)
    ref.save_pretrained(tmp_path / "hf")
    expected = hf_logits(ref, tokens())

    ckpt = from_hf(tmp_path / "hf", tmp_path / "run")
    assert ckpt == tmp_path / "run" / "checkpoints" / "step_00000000"
    model, state = megaloom_from_run(tmp_path / "run")
    assert state["step"] == 0 and state["has_optimizer_state"] is False
    if head_dim:
        assert load_config(tmp_path / "run" / "config.yaml").model.head_dim == head_dim
    with torch.no_grad():
        torch.testing.assert_close(model(tokens()), expected, atol=ATOL, rtol=0)

    # sharded on the way back (tiny shard limit), then read by transformers
    to_hf(tmp_path / "run", tmp_path / "back", show_progress=False, max_shard_bytes=40_000)
    assert (tmp_path / "back" / "model.safetensors.index.json").is_file()
    back = type(ref).from_pretrained(tmp_path / "back").eval()
    torch.testing.assert_close(hf_logits(back, tokens()), expected, atol=ATOL, rtol=0)
    for k, v in ref.state_dict().items():
        if k in back.state_dict():
            assert torch.equal(back.state_dict()[k], v), k


def test_sharded_hf_import_and_optimizer_starts_fresh(tmp_path):
    ref = hf_model("gpt2", tied=False)
    ref.save_pretrained(tmp_path / "hf", max_shard_size="100KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    with pytest.warns(UserWarning, match="no tokenizer.json; set data.tokenizer"):
        from_hf(tmp_path / "hf", tmp_path / "run")
    model, _ = megaloom_from_run(tmp_path / "run")
    with torch.no_grad():
        torch.testing.assert_close(model(tokens()), hf_logits(ref, tokens()), atol=ATOL, rtol=0)
    # the trainer's resume path: an optimizer is passed, the model-only checkpoint leaves it fresh
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = load_checkpoint(tmp_path / "run/checkpoints/step_00000000", model, opt)
    assert state["step"] == 0 and len(opt.state) == 0


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_megaloom_checkpoint_exports_with_equal_logits(tmp_path, arch):
    cfg = load_config(None, [f"model.preset={'tiny' if arch == 'llama' else 'tiny-gpt2'}",
                             f"model.vocab_size={VOCAB}", "model.d_model=64", "model.n_layers=2",
                             "model.n_heads=4", f"model.n_kv_heads={2 if arch == 'llama' else 4}",
                             "model.ffn_dim=96", "model.max_seq_len=64", "model.rope_theta=500",
                             "model.tie_embeddings=false", "train.seq_len=32", f"run.dir={tmp_path / 'run'}"])
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = tokens(32)
    for _ in range(2):  # move the weights off their init (norms included)
        model(x, x).backward()
        opt.step()
        opt.zero_grad()
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text(cfg.to_yaml())
    ckpt = save_checkpoint(tmp_path / "run" / "checkpoints", 2, model, opt, {"model": cfg.model.__dict__}, keep=2)

    to_hf(ckpt, tmp_path / "hf", show_progress=False)
    hf_cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert hf_cfg["architectures"] == ["LlamaForCausalLM" if arch == "llama" else "GPT2LMHeadModel"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        torch.testing.assert_close(hf_logits(hf, tokens()), model.eval()(tokens()), atol=ATOL, rtol=0)


def test_tokenizer_travels_both_ways(tmp_path):
    from tokenizers import Tokenizer, models

    tok = Tokenizer(models.WordLevel({"<unk>": 0, "<|endoftext|>": 1, "a": 2}, unk_token="<unk>"))
    ref = hf_model("llama", tied=True)
    ref.save_pretrained(tmp_path / "hf")
    tok.save(str(tmp_path / "hf" / "tokenizer.json"))
    from_hf(tmp_path / "hf", tmp_path / "run")
    cfg = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert cfg["data"]["tokenizer"] == str((tmp_path / "run" / "tokenizer.json").resolve())
    to_hf(tmp_path / "run", tmp_path / "back", show_progress=False)
    assert (tmp_path / "back" / "tokenizer.json").read_bytes() == (tmp_path / "hf" / "tokenizer.json").read_bytes()
    assert json.loads((tmp_path / "back" / "config.json").read_text())["eos_token_id"] == 1
    fast = transformers.AutoTokenizer.from_pretrained(tmp_path / "back")
    assert fast.convert_tokens_to_ids("a") == 2
    # issue 24 (7): AutoTokenizer knows the end-of-document token that config.json names
    assert fast.eos_token == "<|endoftext|>" and fast.eos_token_id == 1 and fast.bos_token_id == 1
    # and the weights are readable like every other exported file (save_file alone makes them 0600)
    modes = {f.name: f.stat().st_mode & 0o777 for f in (tmp_path / "back").iterdir()}
    assert modes["model.safetensors"] == modes["config.json"] == modes["tokenizer.json"], modes
