"""The t5 family: the span-corruption objective (counts, reconstruction, sentinels, determinism over resumes and
data-parallel layouts), the encoder-decoder's masks, recomputation, refusals and a CPU training smoke."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models as tk_models

from megaloom.config import ConfigError, load_config
from megaloom.data.loader import StepBatches
from megaloom.data.objective import ObjectiveDataset
from megaloom.data.tokenizer import Tokenizer
from megaloom.models.registry import get_family
from megaloom.models.t5.spans import SpanCorruptionObjective, encoder_length, lengths, span_counts
from megaloom.preflight import preflight
from tests.conftest import assert_recompute_keeps_grads, cli_run_losses

V, EOD, SEQ = 1000, 0, 128


@dataclass(frozen=True)
class PlainTokenizer:
    vocab_size: int = V
    eod_id: int = EOD


class Rows:
    def __len__(self) -> int:
        return 10**6

    def __getitem__(self, i: int) -> np.ndarray:
        return np.random.default_rng(10_000 + i).integers(1, V, SEQ + 1)


def objective(seed: int = 5, tokenizer=None, seq: int = SEQ):
    cfg = load_config(None, ["model.preset=t5-tiny", f"train.seed={seed}", f"train.seq_len={seq}"])
    return SpanCorruptionObjective.build(cfg, tokenizer or PlainTokenizer())


def undo(obj, inputs: np.ndarray, targets: np.ndarray) -> list[int]:
    """The original row from the encoder input and the target: each sentinel replaced by the span it hides."""
    spans, current = {}, None
    for t in targets[:-1]:
        if t in obj.sentinels:
            current = int(t)
            spans[current] = []
        else:
            spans[current].append(int(t))
    out = []
    for t in inputs[:-1]:
        out += spans[int(t)] if t in obj.sentinels else [int(t)]
    return out


def test_span_corruption_counts_spans_and_reconstruction():
    obj = objective()
    noise, spans = span_counts(SEQ)
    te, td = lengths(SEQ)
    assert (noise, spans, te, td) == (19, 6, 116, 26) and encoder_length(te + td) == te
    assert obj.start_id == V and obj.sentinels.tolist() == list(range(V + 1, V + 1 + spans))
    assert obj.vocab_size == V + 1 + spans
    data = ObjectiveDataset(Rows(), obj, "train")
    span_lengths, starts = [], []
    for i in range(300):
        row, labels = data[i]
        enc, dec, tgt = row[:te], row[te:], labels[te:]
        assert (labels[:te] == -100).all() and (tgt != -100).all()
        assert enc[-1] == tgt[-1] == EOD and dec[0] == obj.start_id and (dec[1:] == tgt[:-1]).all()
        assert [t for t in enc if t in obj.sentinels] == obj.sentinels.tolist()  # every sentinel once, in order
        assert undo(obj, enc, tgt) == Rows()[i][:SEQ].tolist()  # nothing lost, nothing moved
        hidden = np.split(tgt[:-1], np.flatnonzero(np.isin(tgt[:-1], obj.sentinels))[1:])
        span_lengths += [len(h) - 1 for h in hidden]
        starts.append(int(np.flatnonzero(enc == obj.sentinels[0])[0]))
    assert min(span_lengths) >= 1 and abs(np.mean(span_lengths) - noise / spans) < 1e-9  # 19 / 6: mean ~3
    assert np.std(span_lengths) > 0.5 and len(set(starts)) > 20  # spans of varied lengths at varied places


def test_spans_are_a_function_of_seed_split_and_index_only():
    data = ObjectiveDataset(Rows(), objective(), "train")
    whole = StepBatches(data, 8, n_steps=4)
    resumed = StepBatches(data, 8, start_step=2, n_steps=2)
    halves = [StepBatches(data, 8, rank_offset=r * 4, rank_size=4, n_steps=4) for r in (0, 1)]
    for k in range(4):
        assert torch.equal(torch.cat([h[k] for h in halves]), whole[k])
        if k >= 2:
            assert torch.equal(resumed[k - 2], whole[k])
    assert not np.array_equal(ObjectiveDataset(Rows(), objective(seed=6), "train")[3], data[3])
    assert not np.array_equal(ObjectiveDataset(Rows(), objective(), "valid")[3], data[3])


def test_the_tokenizers_own_sentinels_and_pad_are_used():
    vocab = {"<pad>": 0, "</s>": 1, **{f"w{i}": i for i in range(2, 90)},
             **{f"<extra_id_{k}>": 99 - k for k in range(10)}}
    hf = HFTokenizer(tk_models.WordLevel(vocab, unk_token="<pad>"))
    hf.add_special_tokens(["<pad>", "</s>", *[f"<extra_id_{k}>" for k in range(10)]])
    obj = objective(tokenizer=Tokenizer(hf), seq=64)
    assert (obj.start_id, obj.eos_id, obj.vocab_size) == (0, 1, 100)
    assert obj.sentinels.tolist() == [99 - k for k in range(span_counts(64)[1])]


def test_decoder_is_causal_and_reads_the_whole_encoder():
    cfg = load_config(None, ["model.preset=t5-tiny", "model.vocab_size=64"])
    torch.manual_seed(0)
    model = get_family("t5").build(cfg.model).eval()
    enc, dec = torch.randint(0, 64, (1, 12)), torch.randint(0, 64, (1, 8))
    enc2, dec2 = enc.clone(), dec.clone()
    enc2[0, -1] = (enc[0, -1] + 1) % 64
    dec2[0, -1] = (dec[0, -1] + 1) % 64
    with torch.no_grad():
        base = model.seq2seq(enc, dec)
        assert (model.seq2seq(enc2, dec) - base)[0, 0].abs().max() > 1e-5  # the last encoder token reaches all
        later = model.seq2seq(enc, dec2) - base
        assert later[0, :-1].abs().max() == 0 and later[0, -1].abs().max() > 1e-5  # the future does not


def _tiny_model_and_batch():
    """t5-tiny (vocabulary 64), two span-corruption-shaped rows of a 16-token sequence: -100 over the encoder part."""
    cfg = load_config(None, ["model.preset=t5-tiny", "model.vocab_size=64"])
    torch.manual_seed(0)
    model = get_family("t5").build(cfg.model)
    te, td = lengths(16)
    x = torch.randint(0, 64, (2, te + td))
    y = torch.cat([torch.full((2, te), -100), torch.randint(0, 64, (2, td))], dim=1)
    return model, x, y


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recomputation_gives_the_same_gradients(mode):
    assert_recompute_keeps_grads(*_tiny_model_and_batch(), mode)


@pytest.mark.parametrize("override,key", [("parallel.tp=2 parallel.sp=true", "train.seq_len=16 would"),
                                          ("parallel.pp=2", "parallel.pp"),
                                          ("parallel.cp=2", "parallel.cp"),
                                          ("data.document_mask=true", "data.document_mask")])
def test_refusals_name_the_setting(override, key):
    with pytest.raises(ConfigError, match=key):
        preflight(load_config(None, ["model.preset=t5-tiny", "model.n_layers=2", "train.seq_len=18",
                                     *override.split()]), 2)


def test_cli_training_smoke_loss_falls(small_corpus, tmp_path):
    """`megaloom train model.preset=t5-tiny` on the small corpus: the span-corruption loss falls, eval runs."""
    run = tmp_path / "run"
    # T5 trains at a high rate (Adafactor 1e-2 in the paper)
    first, last, records = cli_run_losses(small_corpus, run, "t5-tiny", "train.lr=1e-2")
    assert last < first - 0.5, (first, last)
    assert records[-1]["eval_loss"] is not None
    resolved = load_config(run / "config.yaml")
    assert resolved.model.arch == "t5" and resolved.model.vocab_size == 576  # 512 + <pad> + 3 sentinels, padded


def test_bf16_autocast_loss_close_to_fp32():
    model, x, y = _tiny_model_and_batch()
    with torch.no_grad():
        ref = model(x, y)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = model(x, y)
    assert low.dtype == torch.float32 and abs(low.item() - ref.item()) < 0.05 * ref.item()
