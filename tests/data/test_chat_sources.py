"""Chat data as it comes from the Hugging Face Hub (issue 49): a Parquet file, a datasets ``*.arrow`` file, a
``save_to_disk`` folder (a Dataset, or a DatasetDict whose split data.chat_split names) and a folder holding them,
each with the conversations in a ``messages`` column (or the column data.chat_column names), read into exactly the
tokens and loss masks the same conversations give as JSONL (which tests/data/test_chat_hf.py checks against
transformers' apply_chat_template(..., return_assistant_tokens_mask=True)). Skipped without pyarrow / datasets."""

from __future__ import annotations

import json

import numpy as np
import pytest

from megaloom.data.chat.dataset import build_chat_datasets
from megaloom.data.chat.encode import EncodedChats
from megaloom.data.chat.records import chat_files, check_chat_files, read_conversations
from megaloom.data.errors import DataError
from tests.data.conftest import write_chats

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
SEQ = 256
N = 40


def _rows(jsonl) -> list[dict]:
    return [json.loads(line) for line in open(jsonl)]


def _table(rows: list[dict], column: str = "messages"):
    # A struct field only some messages have (as tool-calling sets carry): Arrow fills the others with null.
    rows = [{column: [dict(m, name="calc") if j == 1 and i % 4 == 0 else m for j, m in enumerate(r["messages"])]}
            for i, r in enumerate(rows)]
    return pa.Table.from_pylist(rows)


def _saved(table, folder, splits: dict | None = None):
    datasets = pytest.importorskip("datasets")
    if splits is None:
        datasets.Dataset(table, fingerprint="chat").save_to_disk(str(folder))
    else:
        datasets.DatasetDict({name: datasets.Dataset(t, fingerprint=f"chat-{name}") for name, t in splits.items()}
                             ).save_to_disk(str(folder))
    return folder


def _encoded(chat_cfg_of, paths, **overrides):
    train, _, tok = build_chat_datasets(chat_cfg_of(paths, **overrides), SEQ, seed=3, n_train=6, n_valid=2)
    return train.chats, tok


@pytest.fixture
def chat_cfg_of(make_cfg, chat_tokenizer, tmp_path):
    def make(paths, **overrides):
        base = dict(paths=[str(p) for p in paths], tokenizer=str(chat_tokenizer), format="chat", split="90,10",
                    cache_dir=str(tmp_path / "cache"), document_mask=True, reset_positions=True)
        return make_cfg(**(base | overrides))

    return make


@pytest.fixture
def jsonl(tmp_path):
    return write_chats(tmp_path / "chats.jsonl", N)


def _same(a, b) -> None:
    assert np.array_equal(a.tokens, b.tokens) and np.array_equal(a.targets, b.targets)
    assert np.array_equal(a.offsets, b.offsets)


def test_parquet_and_arrow_and_saved_datasets_read_as_the_jsonl_does(chat_cfg_of, jsonl, tmp_path):
    ref, _ = _encoded(chat_cfg_of, [jsonl])
    table = _table(_rows(jsonl))
    pq.write_table(table, tmp_path / "chats.parquet", row_group_size=7)  # several row groups, read in order
    got, _ = _encoded(chat_cfg_of, [tmp_path / "chats.parquet"])
    _same(got, ref)
    first = next(read_conversations(tmp_path / "chats.parquet")).messages
    assert first[1] == dict(_rows(jsonl)[0]["messages"][1], name="calc")
    assert all(None not in m.values() for m in first)  # Arrow's null fields are left out

    saved = _saved(table, tmp_path / "saved")
    _same(_encoded(chat_cfg_of, [saved])[0], ref)  # the folder save_to_disk wrote ("dataset_info.json" is not data)
    (arrow,) = saved.glob("*.arrow")
    _same(_encoded(chat_cfg_of, [arrow])[0], ref)

    # a DatasetDict: the split named; the Hub's folder of several sources read in name order
    half = table.num_rows // 2
    dd = _saved(None, tmp_path / "dd", {"train": table.slice(0, half), "test": table.slice(half)})
    with pytest.raises(DataError, match=r"DatasetDict of 2 splits \(test, train\): choose the one to train on with "
                                        r"data.chat_split, e.g. data.chat_split=test"):
        check_chat_files([str(dd)])
    with pytest.raises(DataError, match="without a 'valid' split .* set data.chat_split"):
        check_chat_files([str(dd)], split="valid")
    assert check_chat_files([str(dd)], split="train") == half
    _same(_encoded(chat_cfg_of, [dd], chat_split="train")[0], EncodedChats(*_slice(ref, 0, half)))
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    pq.write_table(table.slice(0, 5), mixed / "a.parquet")
    _saved(table.slice(5, 5), mixed / "b")
    (mixed / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _rows(jsonl)[10:15]))
    assert [p.name for p in chat_files([str(mixed)])] == ["a.parquet", "b", "c.jsonl"]
    assert check_chat_files([str(mixed)]) == 15


def _slice(enc, first: int, last: int):
    s, e = int(enc.offsets[first]), int(enc.offsets[last])
    return enc.tokens[s:e], enc.targets[s:e], enc.offsets[first:last + 1] - s


def test_the_column_is_named_by_data_chat_column_and_bad_rows_are_one_line(chat_cfg_of, jsonl, tmp_path):
    rows = _rows(jsonl)
    pq.write_table(_table(rows, "conversation"), tmp_path / "c.parquet")
    with pytest.raises(DataError, match=r"c.parquet has no column 'messages' \(its columns: conversation\); set "
                                        "data.chat_column"):
        check_chat_files([str(tmp_path / "c.parquet")])
    ref, _ = _encoded(chat_cfg_of, [jsonl])
    _same(_encoded(chat_cfg_of, [tmp_path / "c.parquet"], chat_column="conversation")[0], ref)

    bad = [*rows[:3], {"messages": [{"role": "user", "content": "no answer"}]}]
    pq.write_table(pa.Table.from_pylist(bad), tmp_path / "bad.parquet")
    with pytest.raises(DataError, match=r"bad.parquet row 3: no \"assistant\" message to train on .* each row of a "
                                        "data.paths table must hold one conversation in data.chat_column"):
        check_chat_files([str(tmp_path / "bad.parquet")])
    pq.write_table(pa.Table.from_pylist([{"messages": "hello"}]), tmp_path / "text.parquet")
    with pytest.raises(DataError, match=r"text.parquet row 0: column 'messages' holds str, not a list of messages"):
        check_chat_files([str(tmp_path / "text.parquet")])


def test_a_chat_run_trains_on_a_saved_dataset_and_its_checkpoint_names_it(chat_cfg_of, jsonl, tmp_path):
    """The checkpoint's record of the data (data identity) reads a save_to_disk folder as one source."""
    from megaloom.data.chat.identity import chat_identity
    from megaloom.data.tokenizer import Tokenizer

    saved = _saved(_table(_rows(jsonl)), tmp_path / "saved")
    cfg = chat_cfg_of([saved])
    (ident,) = chat_identity(cfg, Tokenizer.from_file(cfg.tokenizer))
    assert ident["path"] == str(saved.resolve()) and ident["bytes"] > 0
    assert ident == chat_identity(cfg, Tokenizer.from_file(cfg.tokenizer))[0]  # stable
    other = chat_identity(chat_cfg_of([saved], chat_column="other"), Tokenizer.from_file(cfg.tokenizer))[0]
    assert other["render"] != ident["render"] and other["hash"] == ident["hash"]


def test_megaloom_train_on_a_saved_datasetdict_split_and_resume(jsonl, chat_tokenizer, tmp_path):
    """`megaloom train data.format=chat data.paths=<save_to_disk folder> data.chat_split=train`, resumed with its
    config.yaml: the same conversations, so the resume is accepted (the data identity of a folder is stable)."""
    from megaloom.cli import main
    from tests.data.test_chat_train import overrides

    table = _table(_rows(jsonl))
    dd = _saved(None, tmp_path / "dd", {"train": table, "test": table.slice(0, 4)})
    args = [a for a in overrides(tmp_path, chat_tokenizer, "run") if not a.startswith("data.paths=")]
    assert main(["train", *args, f"data.paths={dd}", "data.chat_split=train", "train.steps=2",
                 "checkpoint.every=2"]) == 0
    assert main(["train", "--config", str(tmp_path / "run" / "config.yaml"), "train.steps=3"]) == 0
    steps = [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]
