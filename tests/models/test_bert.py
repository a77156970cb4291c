"""The bert family: the masked-LM objective (statistics, specials, determinism over resumes and data-parallel
layouts), the encoder's model (bidirectional, its plan, refusals), a CPU training smoke of bert-tiny, and the
optional sentence-order prediction (rows, statistics, the loss, refusals, a training smoke)."""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models as tk_models

from megaloom.checkpoint.store import CheckpointError, check_compatible
from megaloom.cli import main
from megaloom.config import ConfigError, load_config
from megaloom.convert.errors import ConversionError
from megaloom.convert.hf_config import hf_config
from megaloom.data.loader import StepBatches
from megaloom.data.objective import ObjectiveDataset, inputs_and_labels, objective_kwargs
from megaloom.data.tokenizer import Tokenizer
from megaloom.generate import load_for_generation
from megaloom.models import Transformer
from megaloom.models.bert.masking import MaskedLMObjective
from megaloom.models.registry import get_family
from megaloom.models.transformer import Span
from megaloom.preflight import preflight
from megaloom.train import train
from megaloom.training.trainer import Trainer
from tests.conftest import assert_recompute_keeps_grads, cli_run_losses, tiny_overrides

V, EOD, SEQ = 1000, 0, 128


@dataclass(frozen=True)
class PlainTokenizer:
    """A tokenizer with only an end-of-document token (as megaloom's byte-level BPE): [MASK], [CLS] and [SEP]
    are then reserved past its vocabulary."""

    vocab_size: int = V
    eod_id: int = EOD


class Rows:
    """Token rows of SEQ + 1 random ids with end-of-document tokens sprinkled in (a packed dataset)."""

    def __len__(self) -> int:
        return 10**6

    def __getitem__(self, i: int) -> np.ndarray:
        rng = np.random.default_rng(10_000 + i)
        row = rng.integers(1, V, SEQ + 1)
        row[rng.integers(0, SEQ + 1, 3)] = EOD
        return row


def objective(seed: int = 5, tokenizer=None):
    cfg = load_config(None, ["model.preset=bert-tiny", f"train.seed={seed}", f"train.seq_len={SEQ}"])
    return MaskedLMObjective.build(cfg, tokenizer or PlainTokenizer())


def test_masking_statistics_and_specials():
    obj = objective()
    assert (obj.mask_id, obj.cls_id, obj.sep_id, obj.vocab_size) == (V, V + 1, V + 2, V + 3)
    data = ObjectiveDataset(Rows(), obj, "train")
    chosen = candidates = masked = randomised = kept = 0
    for i in range(400):
        row = Rows()[i]
        inputs, labels = data[i]
        assert inputs.shape == labels.shape == (SEQ,) and inputs.dtype == labels.dtype == np.int64
        original = np.concatenate([[obj.cls_id], row[:SEQ - 2], [obj.sep_id]])
        assert inputs[0] == obj.cls_id and inputs[-1] == obj.sep_id  # specials stay ...
        at = labels != -100
        assert not np.isin(original[at], [EOD, obj.cls_id, obj.sep_id, obj.mask_id]).any()  # ... never chosen
        assert (inputs[original == EOD] == EOD).all()
        assert (labels[at] == original[at]).all() and (inputs[~at] == original[~at]).all()
        n_cand = int((~np.isin(original, [EOD, obj.cls_id, obj.sep_id])).sum())
        assert at.sum() in (int(0.15 * n_cand), int(0.15 * n_cand) + 1)  # 15% per row, rounded either way
        candidates += n_cand
        chosen += int(at.sum())
        masked += int((inputs[at] == obj.mask_id).sum())
        changed = at & (inputs != obj.mask_id) & (inputs != original)
        assert (inputs[changed] < V).all() and (inputs[changed] != EOD).all()  # random ids are ordinary tokens
        randomised += int(changed.sum())
        kept += int((at & (inputs == original)).sum())
    assert abs(chosen / candidates - 0.15) < 0.002
    # ~7,700 chosen tokens: 80/10/10 within about four standard deviations
    assert abs(masked / chosen - 0.8) < 0.02
    assert abs((randomised + kept) / chosen - 0.2) < 0.02
    assert abs(randomised / chosen - 0.1) < 0.015 and abs(kept / chosen - 0.1) < 0.015  # (a random draw may keep)


def test_masks_are_a_function_of_seed_split_and_index_only():
    a, b = ObjectiveDataset(Rows(), objective(), "train"), ObjectiveDataset(Rows(), objective(), "train")
    order = [7, 3, 7, 0, 11]
    first = {i: a[i] for i in order}  # read twice, in any order, from two objects: the same
    for i in reversed(order):
        assert np.array_equal(b[i], first[i])
    assert not np.array_equal(ObjectiveDataset(Rows(), objective(seed=6), "train")[3][1], first[3][1])
    assert not np.array_equal(ObjectiveDataset(Rows(), objective(), "valid")[3][1], first[3][1])


def test_batches_identical_after_a_resume_and_across_data_parallel_layouts():
    data = ObjectiveDataset(Rows(), objective(), "train")
    whole = StepBatches(data, 8, n_steps=4)
    resumed = StepBatches(data, 8, start_step=2, n_steps=2)
    halves = [StepBatches(data, 8, rank_offset=r * 4, rank_size=4, n_steps=4) for r in (0, 1)]
    for k in range(4):
        assert whole[k].shape == (8, 2, SEQ)
        assert torch.equal(torch.cat([h[k] for h in halves]), whole[k])
        if k >= 2:
            assert torch.equal(resumed[k - 2], whole[k])
    x, y = inputs_and_labels(whole[0])
    assert x.shape == y.shape == (8, SEQ)


def test_the_tokenizers_own_special_tokens_are_used():
    vocab = {"[PAD]": 0, "[CLS]": 1, "[SEP]": 2, "[MASK]": 3, "<|endoftext|>": 4, **{f"w{i}": i for i in range(5, 50)}}
    hf = HFTokenizer(tk_models.WordLevel(vocab, unk_token="[PAD]"))
    hf.add_special_tokens(["[PAD]", "[CLS]", "[SEP]", "[MASK]", "<|endoftext|>"])
    obj = objective(tokenizer=Tokenizer(hf))
    assert (obj.mask_id, obj.cls_id, obj.sep_id, obj.vocab_size) == (3, 1, 2, 50)
    assert set(obj.special.tolist()) == {0, 1, 2, 3, 4} and obj.ordinary.tolist() == list(range(5, 50))


def test_encoder_attends_both_ways_and_matches_the_family_plan():
    cfg = load_config(None, ["model.preset=bert-tiny", "model.vocab_size=64", "model.max_seq_len=16",
                           "train.seq_len=16"])
    torch.manual_seed(0)
    model = Transformer(cfg.model).eval()
    x = torch.randint(0, 64, (1, 16))
    later = x.clone()
    later[0, -1] = (x[0, -1] + 1) % 64
    with torch.no_grad():  # a change at the last position reaches the first one (a causal model: never)
        assert (model(x)[0, 0] - model(later)[0, 0]).abs().max() > 1e-4
    names = dict(model.named_parameters())
    assert {"type_emb.weight", "emb_norm.weight", "norm.dense.weight", "norm.norm.weight", "head.bias"} <= set(names)
    assert model.head.weight is model.tok_emb.weight
    assert model.embedding_parts() == ["tok_emb", "pos_emb", "type_emb", "emb_norm"]
    assert {"bert-tiny", "bert-base", "bert-large"} <= set(get_family("bert").presets)


@pytest.mark.parametrize("override,key", [
    ("data.document_mask=true", "data.document_mask"), ("data.reset_positions=true", "data.reset_positions"),
    ("train.fused_loss=true", "train.fused_loss")])
def test_refusals_name_the_setting(override, key):
    with pytest.raises(ConfigError, match=key):
        preflight(load_config(None, ["model.preset=bert-tiny", override]), 1)


@pytest.mark.parametrize("override,key", [("model.n_kv_heads=1", "model.n_kv_heads"),
                                          ("model.parallel_block=true", "model.parallel_block")])
def test_model_refusals_name_the_setting(override, key):
    with pytest.raises(ConfigError, match=key):
        load_config(None, ["model.preset=bert-tiny", override])


def test_context_parallel_refused():
    with pytest.raises(ConfigError, match="parallel.cp"):
        preflight(load_config(None, ["model.preset=bert-tiny", "parallel.cp=2"]), 2)


def test_cli_training_smoke_loss_falls(small_corpus, tmp_path):
    """`megaloom train model.preset=bert-tiny` on the small corpus: the masked-LM loss falls, eval runs."""
    run = tmp_path / "run"
    first, last, records = cli_run_losses(small_corpus, run, "bert-tiny")
    assert last < first - 0.5, (first, last)
    assert records[-1]["eval_loss"] is not None
    resolved = load_config(run / "config.yaml")
    assert resolved.model.arch == "bert" and resolved.model.vocab_size == 576  # 512 tokens + [MASK] [CLS] [SEP]


def test_exact_resume_after_stop(small_corpus, tmp_path):
    """The masks of the steps after a resume are the uninterrupted run's: the losses are bit-identical."""
    base = ["model.preset=bert-tiny", "model.n_kv_heads=0", "train.steps=8", "checkpoint.every=4", "model.dropout=0.1"]
    data = [o for o in tiny_overrides(small_corpus, tmp_path / "a") if not o.startswith("model.")]
    ref = train(load_config(None, [*data, *base]))
    part_cfg = [o.replace(str(tmp_path / "a"), str(tmp_path / "b")) for o in data]
    assert train(load_config(None, [*part_cfg, *base]), stop_after=6).final_step == 6  # newest checkpoint: 4
    resumed = train(load_config(None, [*part_cfg, *base]))
    for step in range(5, 9):
        assert resumed.losses[step] == ref.losses[step], step  # bit-exact on CPU fp32


def test_generate_refuses_an_encoder(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(load_config(None, ["model.preset=bert-tiny", "model.vocab_size=64"]).to_yaml())
    with pytest.raises(ConfigError, match="neither a decoder nor an encoder-decoder"):
        load_for_generation(run, torch.device("cpu"))


def _tiny_model_and_batch():
    """bert-tiny (vocabulary 64, sequence 16), two rows and labels at about 30% of the positions."""
    cfg = load_config(None, ["model.preset=bert-tiny", "model.vocab_size=64", "model.max_seq_len=16",
                             "train.seq_len=16"])
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    x = torch.randint(0, 64, (2, 16))
    y = torch.where(torch.rand(2, 16, generator=torch.Generator().manual_seed(1)) < 0.3, x, -100)
    return model, x, y


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recomputation_gives_the_same_gradients(mode):
    assert_recompute_keeps_grads(*_tiny_model_and_batch(), mode)


def test_bf16_autocast_loss_close_to_fp32():
    model, x, y = _tiny_model_and_batch()
    with torch.no_grad():
        ref = model(x, y)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = model(x, y)
    assert low.dtype == torch.float32 and abs(low.item() - ref.item()) < 0.05 * ref.item()


def test_a_vocabulary_without_room_for_the_objectives_ids_is_refused(small_corpus, tmp_path):
    data = [o for o in tiny_overrides(small_corpus, tmp_path / "r") if not o.startswith("model.")]
    cfg = load_config(None, [*data, "model.preset=bert-tiny", "model.vocab_size=512"])
    with pytest.raises(ConfigError, match=r"model.vocab_size=512: .* 3 special ids .* model.vocab_size>=515"):
        Trainer(cfg).build()


# ------------------------------------------------------------------------ sentence-order prediction (ALBERT)


def sop_objective(seed: int = 5):
    cfg = load_config(None, ["model.preset=bert-tiny", "model.sentence_order=true", f"train.seed={seed}",
                             f"train.seq_len={SEQ}"])
    return MaskedLMObjective.build(cfg, PlainTokenizer())


def test_sentence_order_rows_halves_segments_and_statistics():
    obj = sop_objective()
    data = ObjectiveDataset(Rows(), obj, "train")
    swapped = 0
    body_len = SEQ - 3
    half = body_len // 2
    for i in range(400):
        row = Rows()[i]
        sample = data[i]
        assert sample.shape == (4, SEQ) and sample.dtype == np.int64
        inputs, labels, segments, order = sample
        assert len(set(order.tolist())) == 1 and order[0] in (0, 1)  # one label, repeated along the row
        a, b = row[:half], row[half:body_len]  # the two halves of the row's body, consecutive text
        first, second = (b, a) if order[0] else (a, b)
        original = np.concatenate([[obj.cls_id], first, [obj.sep_id], second, [obj.sep_id]])
        seps = [len(first) + 1, SEQ - 1]
        assert inputs[0] == obj.cls_id and (inputs[seps] == obj.sep_id).all()
        at = labels != -100
        assert not at[[0, *seps]].any()  # [CLS] and [SEP] are never chosen
        assert (labels[at] == original[at]).all() and (inputs[~at] == original[~at]).all()
        n_cand = int((~np.isin(original, [EOD, obj.cls_id, obj.sep_id])).sum())
        assert at.sum() in (int(0.15 * n_cand), int(0.15 * n_cand) + 1)
        assert (segments[:len(first) + 2] == 0).all() and (segments[len(first) + 2:] == 1).all()
        swapped += int(order[0])
    assert 160 <= swapped <= 240, swapped  # p = 0.5 over 400 rows: within four standard deviations


def test_sentence_order_is_a_function_of_seed_split_and_index_only():
    a, b = ObjectiveDataset(Rows(), sop_objective(), "train"), ObjectiveDataset(Rows(), sop_objective(), "train")
    first = {i: a[i] for i in (9, 2, 9, 4)}
    for i in (4, 9, 2):
        assert np.array_equal(b[i], first[i])
    other_seed = ObjectiveDataset(Rows(), sop_objective(seed=6), "train")
    assert any(other_seed[i][3, 0] != a[i][3, 0] for i in range(20))  # the swaps come from the seed
    whole = StepBatches(a, 8, n_steps=2)
    resumed = StepBatches(a, 8, start_step=1, n_steps=1)
    assert whole[1].shape == (8, 4, SEQ) and torch.equal(resumed[0], whole[1])
    x, y = inputs_and_labels(whole[1])
    assert torch.equal(x, whole[1][:, 0]) and torch.equal(y, whole[1][:, 1])
    kw = objective_kwargs(whole[1])
    assert torch.equal(kw["segments"], whole[1][:, 2]) and torch.equal(kw["order_labels"], whole[1][:, 3, 0])
    assert objective_kwargs(StepBatches(ObjectiveDataset(Rows(), objective(), "train"), 8, n_steps=1)[0]) == {}


def test_sentence_order_loss_is_masked_lm_plus_the_pooled_order_cross_entropy():
    cfg = load_config(None, ["model.preset=bert-tiny", "model.sentence_order=true", "model.vocab_size=64",
                             "model.max_seq_len=16", "train.seq_len=16"])
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    assert {"pooler.dense.weight", "pooler.dense.bias", "order_head.weight", "order_head.bias"} <= {
        n for n, _ in model.named_parameters()}
    x = torch.randint(0, 64, (3, 16))
    y = torch.where(torch.rand(3, 16, generator=torch.Generator().manual_seed(1)) < 0.3, x, -100)
    segments = (torch.arange(16) >= torch.tensor([[5], [8], [9]])).long()
    order = torch.tensor([0, 1, 1])
    loss = model(x, y, segments=segments, order_labels=order)
    hidden = model(x, span=Span(model.full_span().layers, head=False), segments=segments)
    mlm = F.cross_entropy(model.head(model.norm(hidden)).reshape(-1, 64), y.reshape(-1))
    sop = F.cross_entropy(model.order_head(torch.tanh(model.pooler.dense(hidden[:, 0]))), order)
    assert torch.allclose(loss, mlm + sop, atol=1e-6), (loss, mlm, sop)
    loss.backward()
    assert model.pooler.dense.weight.grad.abs().sum() > 0 and model.order_head.weight.grad.abs().sum() > 0
    with torch.no_grad():  # the segment ids reach the embedding
        assert (model(x, segments=segments) - model(x)).abs().max() > 1e-4
    with pytest.raises(ValueError, match="order_labels"):
        model(x, y, segments=segments)


def test_sentence_order_refusals_name_the_setting():
    with pytest.raises(ConfigError, match="model.sentence_order"):
        load_config(None, ["model.preset=tiny", "model.sentence_order=true"])  # llama
    with pytest.raises(ConfigError, match="model.sentence_order=true with parallel.pp=2"):
        preflight(load_config(None, ["model.preset=bert-tiny", "model.sentence_order=true", "parallel.pp=2",
                                     "train.micro_batch_size=1"]), 2)
    with pytest.raises(ConversionError, match="model.sentence_order"):
        hf_config(load_config(None, ["model.preset=bert-tiny", "model.sentence_order=true",
                                     "model.vocab_size=64"]).model, "float32")
    with pytest.raises(CheckpointError, match="model.sentence_order: checkpoint False vs config True"):
        check_compatible({"arch": "bert", "sentence_order": False}, {"arch": "bert", "sentence_order": True})
    check_compatible({"arch": "bert"}, {"arch": "bert", "sentence_order": True})  # older checkpoints: no such key


def test_cli_training_with_sentence_order_loss_falls(small_corpus, tmp_path):
    """`megaloom train model.preset=bert-tiny model.sentence_order=true`: masked LM + sentence order, the loss
    falls and evaluation (which reads the same rows) runs."""
    run = tmp_path / "run"
    data = [o for o in tiny_overrides(small_corpus, run) if not o.startswith("model.")]
    assert main(["train", "model.preset=bert-tiny", "model.sentence_order=true", "train.steps=30",
                 "checkpoint.every=0", "train.eval_every=30", *data]) == 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    loss = {r["step"]: r["loss"] for r in records}
    first, last = sum(loss[s] for s in (1, 2, 3)) / 3, sum(loss[s] for s in (28, 29, 30)) / 3
    assert last < first - 0.5, (first, last)
    assert records[-1]["eval_loss"] is not None
    assert load_config(run / "config.yaml").model.sentence_order
