"""Hugging Face interchange of the t5 family (T5ForConditionalGeneration, gated-GeLU), checked by logits and
tensors, and what it refuses."""

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


def hf_config(**changes) -> transformers.T5Config:
    return transformers.T5Config(**{**dict(
        vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=96, num_layers=2, num_heads=4, feed_forward_proj="gated-gelu",
        dropout_rate=0.0, layer_norm_epsilon=1e-6), **changes})


def hf_model():
    """A tiny random T5ForConditionalGeneration in float32, every norm randomised (HF inits them to 1)."""
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(hf_config()).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layer_norm" in name:
                p.normal_(1.0, 0.2)
    return model.eval()


def ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, n), generator=torch.Generator().manual_seed(seed))


def test_hf_t5_imports_with_equal_logits_and_exports_the_same_tensors(tmp_path):
    ref = hf_model()
    ref.save_pretrained(tmp_path / "hf")
    enc, dec = ids(40, 1), ids(150, 2)  # decoder longer than max_distance: the logarithmic buckets too
    with torch.no_grad():
        expected = ref(input_ids=enc, decoder_input_ids=dec).logits

    from_hf(tmp_path / "hf", tmp_path / "run")
    model, cfg = megaloom_from_run(tmp_path / "run")
    m = cfg.model
    assert (m.arch, m.d_model, m.n_heads, m.ffn_dim, m.n_layers, m.norm_eps) == ("t5", 64, 4, 96, 2, 1e-6)
    with torch.no_grad():
        torch.testing.assert_close(model.seq2seq(enc, dec), expected, atol=ATOL, rtol=0)
        # the training layout: encoder and decoder input in one row (spans.py) gives the same logits
        from megaloom.models.t5.spans import lengths
        te, td = lengths(20)
        row = torch.cat([enc[:, :te], dec[:, :td]], dim=1)
        torch.testing.assert_close(model(row), ref(input_ids=enc[:, :te], decoder_input_ids=dec[:, :td]).logits,
                                   atol=ATOL, rtol=0)

    to_hf(tmp_path / "run", tmp_path / "back", show_progress=False)
    hf_cfg = json.loads((tmp_path / "back" / "config.json").read_text())
    assert hf_cfg["architectures"] == ["T5ForConditionalGeneration"] and hf_cfg["model_type"] == "t5"
    back = transformers.AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "back").eval()
    assert type(back) is transformers.T5ForConditionalGeneration
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(back.state_dict()[k], v, atol=0, rtol=0, msg=k)
    with torch.no_grad():
        torch.testing.assert_close(back(input_ids=enc, decoder_input_ids=dec).logits, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("field,value", [("feed_forward_proj", "relu"), ("relative_attention_num_buckets", 16),
                                         ("tie_word_embeddings", False)])
def test_hf_t5_refuses_what_it_would_compute_differently(tmp_path, field, value):
    transformers.T5ForConditionalGeneration(hf_config(**{field: value})).save_pretrained(tmp_path / "hf")
    with pytest.raises(ConversionError, match=field.replace("tie_word_embeddings", "scale_decoder_outputs")):
        from_hf(tmp_path / "hf", tmp_path / "run")


def test_generation_encodes_once_and_decodes_with_a_cache_as_transformers_would(tmp_path):
    """Greedy answers with the KV cache equal those without, and each token is transformers' argmax after the
    same prefix (the start token 0, T5's decoder_start_token_id)."""
    from megaloom.generate import generate

    ref = hf_model()
    ref.save_pretrained(tmp_path / "hf")
    from_hf(tmp_path / "hf", tmp_path / "run")
    model, _ = megaloom_from_run(tmp_path / "run")
    model.decoder_start_id = 0
    enc = ids(12, 3)
    cached = generate(model, enc, 10, temperature=0.0)
    assert cached.shape == (2, 10)
    assert torch.equal(cached, generate(model, enc, 10, temperature=0.0, use_cache=False))
    dec = torch.cat([torch.zeros(2, 1, dtype=torch.long), cached[:, :-1]], dim=1)
    with torch.no_grad():
        assert torch.equal(ref(input_ids=enc, decoder_input_ids=dec).logits.argmax(-1), cached)
