"""The chat loss: only assistant tokens count. Through the model's own loss (plain and fused), the loss equals a
hand computation over the answers' tokens alone, and every masked position gets exactly zero gradient."""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.nn.functional as F

from megaloom.config import ModelConfig
from megaloom.data.chat.dataset import build_chat_datasets
from megaloom.data.loader import stack_rows
from megaloom.models.documents import Documents
from megaloom.models.fused_ce import FusedHeadLoss
from megaloom.models.transformer import Transformer
from megaloom.step import model_inputs
from tests.data.conftest import write_chats

SEQ = 256


@pytest.fixture(scope="module")
def chat_batch(chat_tokenizer, tmp_path_factory):
    from megaloom.config import DataConfig

    root = tmp_path_factory.mktemp("chat_loss")
    cfg = DataConfig(paths=[str(write_chats(root / "chats.jsonl", 40))], tokenizer=str(chat_tokenizer),
                     format="chat", split="90,10", cache_dir=str(root / "cache"), document_mask=True,
                     reset_positions=True)
    train, _, tok = build_chat_datasets(cfg, SEQ, seed=1, n_train=3, n_valid=1)
    return stack_rows([train[i] for i in range(3)]), tok


def _model(vocab: int) -> Transformer:
    torch.manual_seed(0)
    cfg = ModelConfig(arch="llama", vocab_size=(vocab + 63) // 64 * 64, d_model=32, n_layers=2, n_heads=4,
                      n_kv_heads=2, ffn_dim=64, max_seq_len=SEQ)
    return Transformer(cfg)


def _retained(model: Transformer, name: str, store: dict) -> None:
    """Keep the output of ``model.<name>`` and its gradient."""

    def hook(module, args, out):
        out.retain_grad()
        store[name] = out

    getattr(model, name).register_forward_hook(hook)


@pytest.mark.parametrize("fused", [False, True])
def test_masked_tokens_get_zero_gradient_and_the_loss_counts_only_answers(chat_batch, fused):
    batch, tok = chat_batch
    model = _model(tok.vocab_size)
    if fused:  # train.fused_loss: head + loss in chunks (several here), the logits never whole
        model.loss = FusedHeadLoss(chunk_tokens=100)
    seen: dict = {}
    for name in ("tok_emb", "norm") + (() if fused else ("head",)):
        _retained(model, name, seen)
    documents = partial(Documents.from_tokens, eod_id=tok.eod_id, mask=True, reset_positions=True)
    ((x, y, kwargs),) = model_inputs(batch, batch.shape[0], documents)  # as the training step feeds the model
    loss = model(x, y, **kwargs)
    loss.backward()

    head_out = seen.get("head")  # (before the hand computation below calls the head again)
    trained = y != -100
    assert 0 < int(trained.sum()) < trained.numel() // 4  # most tokens are prompts, markup or padding
    hidden = seen["norm"]  # the head's input, one row per position
    logits = model.head(hidden.detach()).float()
    hand = -F.log_softmax(logits, -1)[trained].gather(1, y[trained][:, None]).mean()
    torch.testing.assert_close(loss, hand, rtol=1e-6, atol=1e-6)

    assert (hidden.grad[~trained] == 0).all()  # exactly: masked positions contribute nothing
    assert (hidden.grad[trained].abs().sum(-1) > 0).all()
    if not fused:
        assert (head_out.grad[~trained] == 0).all() and (head_out.grad[trained] != 0).any()  # the logits
    # An end-of-document token (a conversation's end, or padding) is seen by nothing that is trained: its own
    # prediction is never a target and the document mask hides it from the next conversation.
    emb = seen["tok_emb"].grad
    assert (emb[x == tok.eod_id] == 0).all()
    assert (emb[trained].abs().sum(-1) > 0).all()


def test_without_document_masks_later_conversations_see_earlier_ones(chat_batch):
    """The control for the test above: without the mask a conversation's end does get gradient from the next one."""
    batch, tok = chat_batch
    model = _model(tok.vocab_size)
    seen: dict = {}
    _retained(model, "tok_emb", seen)
    ((x, y, _),) = model_inputs(batch, batch.shape[0])
    model(x, y).backward()
    ends = x == tok.eod_id
    ends &= torch.cumsum(y != -100, dim=1) < (y != -100).sum(1, keepdim=True)  # followed by trained tokens
    assert ends.any() and (seen["tok_emb"].grad[ends].abs().sum(-1) > 0).all()
