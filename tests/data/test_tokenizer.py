from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models

from megaloom.data.errors import DataError
from megaloom.data.tokenizer import EOD_TOKEN, Tokenizer, train_bpe

SAMPLES = [
    "the model reads tokens",
    "  leading spaces, trailing tabs\t\n\n",
    "naïve café über 日本語 données 🚀 — never seen: Ωμέγα ελληνικά, עברית, 😀👍🏽",
    "def f(x):\n    return x ** 2  # comment\r\n",
    "",
]


@pytest.mark.parametrize("text", SAMPLES)
def test_round_trip_is_exact(tokenizer_path: Path, text: str) -> None:
    tok = Tokenizer.from_file(tokenizer_path)
    assert tok.decode(tok.encode(text)) == text


def test_encode_batch_matches_encode(tokenizer_path: Path) -> None:
    tok = Tokenizer.from_file(tokenizer_path)
    assert tok.encode_batch(SAMPLES) == [tok.encode(s) for s in SAMPLES]


def test_vocab_and_eod(tokenizer_path: Path) -> None:
    tok = Tokenizer.from_file(tokenizer_path)
    assert tok.vocab_size == 300
    assert tok.eod_id == tok.hf.token_to_id(EOD_TOKEN)
    assert tok.path == tokenizer_path


def test_literal_eod_text_is_not_a_document_boundary(tokenizer_path: Path) -> None:
    tok = Tokenizer.from_file(tokenizer_path)
    ids = tok.encode(f"a{EOD_TOKEN}b")
    assert tok.eod_id not in ids
    assert tok.decode(ids) == f"a{EOD_TOKEN}b"


def test_missing_file_names_path(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"nope.json"):
        Tokenizer.from_file(tmp_path / "nope.json")


def test_corrupt_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(DataError, match=r"bad.json"):
        Tokenizer.from_file(bad)


def test_tokenizer_without_eod(tmp_path: Path) -> None:
    path = tmp_path / "noeod.json"
    HFTokenizer(models.BPE()).save(str(path))
    tok = Tokenizer.from_file(path)
    with pytest.raises(DataError, match=r"end-of-document"):
        _ = tok.eod_id


def test_train_bpe_rejects_tiny_vocab_and_missing_files(tmp_path: Path, text_dir: Path) -> None:
    files = sorted(text_dir.glob("*.txt"))
    with pytest.raises(DataError, match=r"default_vocab_size"):
        train_bpe(files, 100, tmp_path / "t.json", show_progress=False)
    with pytest.raises(DataError, match=r"missing.txt"):
        train_bpe([tmp_path / "missing.txt"], 300, tmp_path / "t.json", show_progress=False)
    assert not (tmp_path / "t.json").exists()


def test_a_vocabulary_smaller_than_asked_is_said_in_one_line(tmp_path: Path, capsys) -> None:
    """A small corpus runs out of pairs to merge before --vocab-size: it used to return fewer tokens silently."""
    from megaloom.cli import main

    corpus = tmp_path / "c.txt"
    corpus.write_text("the model reads tokens and the model writes tokens\n" * 20)
    assert main(["tokenizer", "train", str(corpus), "--vocab-size", "32000", "--out", str(tmp_path / "t.json")]) == 0
    reached = Tokenizer.from_file(tmp_path / "t.json").vocab_size
    (line,) = [x for x in capsys.readouterr().err.splitlines() if "WARNING" in x]
    assert line == (f"WARNING: the tokenizer has {reached:,} tokens, not the 32,000 asked: the corpus ran out of "
                    "pairs to merge (every word in it is already one token); train on more text for a larger "
                    f"vocabulary, or ask for {reached:,} or fewer")
    again = ["tokenizer", "train", str(corpus), "--vocab-size", str(reached), "--out", str(tmp_path / "u.json")]
    assert main(again) == 0
    assert "WARNING" not in capsys.readouterr().err  # the size reached: nothing to say
