"""The loss of a step with masked targets (chat data: only assistant tokens count) is the mean over every target
token of the global batch, whatever the micro-batching: micro-batches holding fewer targets weigh less, as
Megatron-LM's per-token loss and TorchTitan's global token count do (a mean of per-micro-batch means would make
the objective depend on train.micro_batch_size and on the data-parallel size)."""

from __future__ import annotations

import pytest

from megaloom.config import load_config
from megaloom.train import train
from tests.data.conftest import write_chats
from tests.data.test_chat_train import overrides


def test_chat_losses_do_not_depend_on_micro_batching(tmp_path, chat_tokenizer):
    write_chats(tmp_path / "chats.jsonl", 50)
    runs = {}
    for mb in (4, 2, 1):
        cfg = load_config(None, overrides(tmp_path, chat_tokenizer, f"mb{mb}", "train.steps=3", "model.dropout=0",
                                          f"train.micro_batch_size={mb}", "data.num_workers=0"))
        runs[mb] = train(cfg).losses
    for mb in (2, 1):
        for step in (1, 2, 3):
            assert runs[mb][step] == pytest.approx(runs[4][step], rel=1e-5), (mb, step)


def test_chat_layouts_match_the_single_process(tmp_path, chat_tokenizer):
    """dp2 x pp2 at micro-batch 1 (two micro-batches per rank) and cp2 x dp2 train the single process's losses
    (one micro-batch of 4 rows) on conversations of different lengths."""
    from tests.parallel.test_trainer_parallel import losses, torchrun

    write_chats(tmp_path / "chats.jsonl", 50)
    base = ("train.steps=4", "model.dropout=0", "data.num_workers=0", "train.grad_clip=0.5")
    ref = train(load_config(None, overrides(tmp_path, chat_tokenizer, "ref", *base, "train.micro_batch_size=4")))
    layouts = {"dp2pp2": ("parallel.pp=2", "train.micro_batch_size=1"),
               "cp2dp2": ("parallel.cp=2", "train.micro_batch_size=2")}
    for name, extra in layouts.items():
        torchrun(4, overrides(tmp_path, chat_tokenizer, name, *base, *extra))
        got = losses(tmp_path / name)
        for step in range(1, 5):
            assert got[step] == pytest.approx(ref.losses[step], rel=1e-5), (name, step)
