"""Training on chat data end to end: a run stopped and resumed trains exactly the losses of the uninterrupted run
(the rows of step k come from the step alone), and a resume on other conversations or another template is refused."""

from __future__ import annotations

import pytest

from megaloom.config import load_config
from megaloom.data.errors import DataError
from megaloom.train import train
from tests.data.conftest import write_chats


def overrides(tmp_path, chat_tokenizer, run: str, *extra: str) -> list[str]:
    return [f"data.paths={tmp_path / 'chats.jsonl'}", f"data.tokenizer={chat_tokenizer}", "data.format=chat",
            "data.split=90,10", f"data.cache_dir={tmp_path / 'cache'}", f"run.dir={tmp_path / run}",
            "model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=64",
            "model.dropout=0.1", "train.seq_len=256", "train.global_batch_size=4", "train.micro_batch_size=2",
            "train.log_every=1", "train.warmup_steps=2", "train.eval_every=0", "train.eval_batches=1",
            "checkpoint.every=4", "run.tensorboard=false", *extra]


def test_chat_run_resumes_exactly_and_refuses_other_data(tmp_path, chat_tokenizer):
    write_chats(tmp_path / "chats.jsonl", 50)
    base = ["train.steps=8", "data.num_workers=1"]  # a loader worker process, as by default
    ref = train(load_config(None, overrides(tmp_path, chat_tokenizer, "a", *base)))
    cfg = load_config(None, overrides(tmp_path, chat_tokenizer, "b", *base))
    assert cfg.data.document_mask and cfg.data.reset_positions
    assert train(cfg, stop_after=6).final_step == 6  # "crash" after step 6: the newest checkpoint is step 4
    resumed = train(load_config(None, overrides(tmp_path, chat_tokenizer, "b", *base)))
    for step in range(5, 9):
        assert resumed.losses[step] == ref.losses[step], step  # bit-exact on CPU fp32, dropout included
    assert resumed.eval_loss == ref.eval_loss
    assert ref.losses[8] < ref.losses[1]

    more = ["train.steps=10", "data.num_workers=0"]
    with pytest.raises(DataError, match="rendered with another tokenizer or data.chat_template"):
        train(load_config(None, overrides(tmp_path, chat_tokenizer, "b", *more, "data.chat_template=llama3")))
    path = tmp_path / "chats.jsonl"
    path.write_text(path.read_text() + path.read_text().splitlines(keepends=True)[0])
    with pytest.raises(DataError, match=r"trained on other data.*dataset 1 \(.*chats.jsonl\): [\d,]+ bytes then"):
        train(load_config(None, overrides(tmp_path, chat_tokenizer, "b", *more)))
