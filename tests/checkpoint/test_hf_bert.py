"""Hugging Face interchange of the bert family (BertForMaskedLM), checked by logits and tensors, and what it
refuses (other activations, relative positions, grouped-query attention on export)."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from megaloom.convert import ConversionError, from_hf, to_hf  # noqa: E402
from tests.checkpoint.hf_common import megaloom_from_run  # noqa: E402

ATOL = 1e-5
VOCAB = 96
pytestmark = pytest.mark.filterwarnings("ignore:.*has no tokenizer.json")


def hf_config(tied: bool, **changes) -> transformers.BertConfig:
    return transformers.BertConfig(**{**dict(
        hidden_size=64, intermediate_size=96, num_attention_heads=4, num_hidden_layers=2, vocab_size=VOCAB,
        max_position_embeddings=32, layer_norm_eps=1e-12, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        tie_word_embeddings=tied), **changes})


def hf_model(tied: bool):
    """A tiny random BertForMaskedLM in float32; every LayerNorm and bias randomised (HF inits them to 1 / 0), so
    a swapped norm or a dropped bias (the head's included) would show in the logits."""
    torch.manual_seed(0)
    model = transformers.BertForMaskedLM(hf_config(tied)).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "LayerNorm" in name:
                p.normal_(1.0 if name.endswith("weight") else 0.0, 0.2)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
    return model.eval()


def tokens(n: int = 24) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, n), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("tied", [True, False])
def test_hf_bert_imports_with_equal_logits_and_exports_the_same_tensors(tmp_path, tied):
    ref = hf_model(tied)
    ref.save_pretrained(tmp_path / "hf")
    with torch.no_grad():
        expected = ref(tokens()).logits

    from_hf(tmp_path / "hf", tmp_path / "run")
    model, cfg = megaloom_from_run(tmp_path / "run")
    m = cfg.model
    assert (m.arch, m.d_model, m.n_heads, m.ffn_dim, m.tie_embeddings, m.norm_eps) == ("bert", 64, 4, 96, tied, 1e-12)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens()), expected, atol=ATOL, rtol=0)

    to_hf(tmp_path / "run", tmp_path / "back", show_progress=False)
    hf_cfg = json.loads((tmp_path / "back" / "config.json").read_text())
    assert hf_cfg["architectures"] == ["BertForMaskedLM"] and hf_cfg["model_type"] == "bert"
    back = transformers.AutoModelForMaskedLM.from_pretrained(tmp_path / "back").eval()
    assert type(back) is transformers.BertForMaskedLM
    assert back.state_dict().keys() == ref.state_dict().keys()
    for k, v in ref.state_dict().items():
        if k == "cls.predictions.bias" and not tied:  # untied, HF's decoder adds decoder.bias: this one is unused
            continue
        torch.testing.assert_close(back.state_dict()[k], v, atol=0, rtol=0, msg=k)
    with torch.no_grad():
        torch.testing.assert_close(back(tokens()).logits, expected, atol=ATOL, rtol=0)


def test_hf_bert_pretraining_checkpoint_drops_pooler_and_next_sentence_head(tmp_path):
    """A BertForPreTraining export (what the released checkpoints are) imports as the masked-LM model."""
    torch.manual_seed(0)
    pre = transformers.BertForPreTraining(hf_config(True)).eval()
    pre.save_pretrained(tmp_path / "hf")
    from_hf(tmp_path / "hf", tmp_path / "run")
    model, _ = megaloom_from_run(tmp_path / "run")
    with torch.no_grad():
        torch.testing.assert_close(model(tokens()), pre(tokens()).prediction_logits, atol=ATOL, rtol=0)


@pytest.mark.parametrize("field,value", [("hidden_act", "relu"), ("position_embedding_type", "relative_key"),
                                         ("is_decoder", True), ("type_vocab_size", 3)])
def test_hf_bert_refuses_what_it_would_compute_differently(tmp_path, field, value):
    model = transformers.BertForMaskedLM(hf_config(True, **{field: value}))
    model.save_pretrained(tmp_path / "hf")
    with pytest.raises(ConversionError, match=field):
        from_hf(tmp_path / "hf", tmp_path / "run")
