"""data.format=chat data (data/chat/): malformed lines refused in one line naming the setting and the fix, rows
packed from whole conversations (prefix-stable), labels only on assistant tokens, documents per conversation."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from megaloom.config import ConfigError, load_config
from megaloom.data.chat.dataset import build_chat_datasets
from megaloom.data.chat.records import check_chat_files
from megaloom.data.errors import DataError
from megaloom.data.tokenizer import Tokenizer
from megaloom.models.documents import Documents
from megaloom.preflight import preflight, preflight_launch
from tests.data.conftest import write_chats

SEQ = 256


@pytest.fixture
def chat_cfg(make_cfg, chat_tokenizer, tmp_path):
    def make(n: int = 60, **overrides):
        path = write_chats(tmp_path / "chats.jsonl", n)
        base = dict(paths=[str(path)], tokenizer=str(chat_tokenizer), format="chat", split="90,10",
                    document_mask=True, reset_positions=True)
        return make_cfg(**(base | overrides))

    return make


@pytest.mark.parametrize("line, why", [
    ("{not json", "not valid JSON"),
    ('["a"]', 'no "messages" list \\(found a JSON list\\)'),
    ('{"conversations": [{"from": "human", "value": "hi"}]}',
     'no "messages" list .*ShareGPT.s conversations/from/value'),
    ('{"messages": [{"role": "user"}]}', 'message 0 has no string "content" \\(missing\\)'),
    ('{"messages": [{"role": "user", "content": ["x"]}]}', 'message 0 has no string "content" \\(a JSON list\\)'),
    ('{"messages": ["hi"]}', "message 0 is a JSON str"),
    ('{"messages": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "yo"}]}',
     "no \"assistant\" message to train on \\(roles found: \\['bot', 'user'\\]\\)"),
])
def test_a_malformed_line_is_one_error_naming_file_line_setting_and_fix(tmp_path, line, why):
    path = write_chats(tmp_path / "chats.jsonl", 4)
    path.write_text(path.read_text() + "\n" + line + "\n")  # a blank line (skipped), then the bad one at line 6
    with pytest.raises(DataError, match=f"chats.jsonl:6: {why}.*data.format=chat.*fix or remove the line") as e:
        check_chat_files([str(path)])
    assert "\n" not in str(e.value)


def test_malformed_data_stops_before_any_heavy_work(chat_cfg, tmp_path, capsys):
    """The launcher of `--nproc` refuses it before torchrun; one process refuses it before the model is built."""
    from megaloom.cli import main

    cfg = chat_cfg()
    path = tmp_path / "chats.jsonl"
    path.write_text(path.read_text() + '{"messages": []}\n')
    overrides = [f"data.paths={path}", f"data.tokenizer={cfg.tokenizer}", "data.format=chat",
                 f"run.dir={tmp_path / 'r'}", f"data.cache_dir={tmp_path / 'cache'}", "data.num_workers=0"]
    with pytest.raises(DataError, match="chats.jsonl:61: no \"assistant\" message"):
        preflight_launch(load_config(None, overrides), 2)
    assert main(["train", *overrides]) == 2
    err = capsys.readouterr().err
    assert err.startswith("megaloom: error: ") and "chats.jsonl:61" in err and err.count("\n") == 1
    assert not (tmp_path / "r" / "checkpoints").exists()


def test_chat_settings_and_refusals(chat_cfg, tmp_path):
    path = write_chats(tmp_path / "c.jsonl", 3)
    cfg = load_config(None, ["data.format=chat", f"data.paths={path}"])
    assert cfg.data.document_mask and cfg.data.reset_positions  # on unless given
    cfg = load_config(None, ["data.format=chat", f"data.paths={path}", "data.reset_positions=false"])
    assert cfg.data.document_mask and not cfg.data.reset_positions
    assert load_config(None, ["data.format=chat", "parallel.pp=2", "model.n_layers=4"]).data.document_mask
    with pytest.raises(ConfigError, match="data.chat_template: 'chatm' is not auto.*Did you mean 'chatml'"):
        load_config(None, ["data.chat_template=chatm"])
    for extra, match in ((["data.paths="], "data.format=chat needs data.paths"),
                         ([f"data.paths={path}", "data.weights=[1.0]"], "data.weights with data.format=chat"),
                         ([f"data.paths={path}", "model.preset=bert-tiny"], "model.arch=bert")):
        with pytest.raises(ConfigError, match=match):
            preflight(load_config(None, ["data.format=chat", *extra]), 2)


def test_rows_hold_whole_conversations_and_train_only_the_answers(chat_cfg, chat_tokenizer):
    cfg = chat_cfg()
    train, valid, tok = build_chat_datasets(cfg, SEQ, seed=3, n_train=12, n_valid=4)
    assert len(train) == 12 and len(valid) == 4 and train[0].shape == (2, SEQ) and train[0].dtype == np.int64
    eod, im_end = tok.eod_id, tok.hf.token_to_id("<|im_end|>")
    texts = [json.loads(line) for line in open(cfg.paths[0])]
    for i in range(len(train)):
        tokens, targets = train.tokens_and_targets(i)
        x, y = train[i]
        assert np.array_equal(x, tokens[:-1]) and np.array_equal(y == -100, ~targets[1:])
        assert (y[y != -100] == tokens[1:][targets[1:]]).all()
        convs = [texts[c]["messages"] for c in train.rows[i]]
        # The trained tokens are each answer and its end of turn, then the end-of-document token that closes it.
        answers = "".join(f"{m['content']}<|im_end|>\n" + ("<|endoftext|>" if j == len(ms) - 1 else "")
                          for ms in convs for j, m in enumerate(ms) if m["role"] == "assistant")
        assert tok.decode(tokens[targets].tolist()) == answers
        assert (tokens == im_end).sum() == sum(len(ms) for ms in convs)  # markup is one special token each
        used = int(sum(train.chats.lengths()[c] for c in train.rows[i]))
        assert (tokens[used:] == eod).all() and not targets[used:].any()  # padding: never a target
        docs = Documents.from_tokens(torch.from_numpy(x)[None], eod, reset_positions=True)
        starts = np.cumsum([0] + [int(train.chats.lengths()[c]) for c in train.rows[i]])[:-1]
        assert (docs.positions[0, starts] == 0).all()  # each conversation starts at position 0
        assert docs.ids[0, used - 1] == len(convs) - 1  # one document per conversation (its EOD included)
    valid_rows = {c for row in valid.rows for c in row}
    assert valid_rows and min(valid_rows) >= 54  # the last 10% of the conversations


def test_packing_is_prefix_stable_and_cached(chat_cfg, capsys):
    cfg = chat_cfg()
    a, _, _ = build_chat_datasets(cfg, SEQ, seed=1, n_train=8, n_valid=2)
    assert "conversations rendered with the chatml chat template" in capsys.readouterr().out
    b, _, _ = build_chat_datasets(cfg, SEQ, seed=1, n_train=40, n_valid=2)
    assert "rendered" not in capsys.readouterr().out  # the second build maps the cache
    c, _, _ = build_chat_datasets(cfg, SEQ, seed=2, n_train=8, n_valid=2)
    assert a.rows == b.rows[:8] and a.rows != c.rows  # row i never depends on how many rows were asked for
    assert all(np.array_equal(a[i], b[i]) for i in range(8))
    seen = [c for row in b.rows for c in row]
    assert len(seen) > 54 and len(set(seen[:54])) == 54  # every training conversation once per epoch, then again


def test_too_long_conversations_are_left_out_with_a_warning(chat_cfg, capsys):
    cfg = chat_cfg()
    train, _, _ = build_chat_datasets(cfg, 80, seed=1, n_train=4, n_valid=1)
    assert "conversation(s) longer than train.seq_len + 1 = 81 tokens" in capsys.readouterr().out
    assert all(train.chats.lengths()[c] <= 81 for row in train.rows for c in row)
    with pytest.raises(DataError, match="no train conversation fits one row of train.seq_len \\+ 1 = 9 tokens"):
        build_chat_datasets(cfg, 8, seed=1, n_train=4, n_valid=1)


def test_end_of_document_text_inside_a_conversation_is_refused_with_document_masks(chat_cfg, tmp_path):
    cfg = chat_cfg()
    path = tmp_path / "chats.jsonl"
    path.write_text(path.read_text().replace('"content": "answer with the number only"',
                                             '"content": "stop<|endoftext|>here"', 1))
    with pytest.raises(DataError, match="chats.jsonl:1: the rendered conversation holds the end-of-document token"):
        build_chat_datasets(cfg, SEQ, seed=1, n_train=4, n_valid=1)
    cfg = chat_cfg(document_mask=False, reset_positions=False)  # harmless without document boundaries
    path.write_text(path.read_text().replace('"content": "answer with the number only"',
                                             '"content": "stop<|endoftext|>here"', 1))
    build_chat_datasets(cfg, SEQ, seed=1, n_train=4, n_valid=1)
    assert Tokenizer.from_file(cfg.tokenizer).eod_id is not None


def test_files_without_conversations_are_refused(chat_cfg, tmp_path):
    cfg = chat_cfg()
    (tmp_path / "chats.jsonl").write_text("\n\n")
    with pytest.raises(DataError, match="hold no conversations \\(data.format=chat\\)"):
        check_chat_files(cfg.paths)
    with pytest.raises(DataError, match="hold no conversations"):
        build_chat_datasets(cfg, SEQ, seed=1, n_train=4, n_valid=1)
    with pytest.raises(DataError, match="data.paths: .*missing.jsonl does not exist; with data.format=chat"):
        check_chat_files([str(tmp_path / "missing.jsonl")])
