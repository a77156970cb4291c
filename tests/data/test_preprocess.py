from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from megaloom.data.errors import DataError
from megaloom.data.indexed import IndexedTokens
from megaloom.data.preprocess import iter_documents, preprocess
from megaloom.data.tokenizer import Tokenizer


def _decoded_docs(prefix: str | Path, tok: Tokenizer) -> list[str]:
    t = IndexedTokens(prefix)
    docs = []
    for i in range(t.n_docs):
        ids = t.doc(i).tolist()
        assert ids[-1] == tok.eod_id and tok.eod_id not in ids[:-1], "exactly one EOD, at the end"
        docs.append(tok.decode(ids[:-1]))
    return docs


def test_folder_round_trip(tokens_prefix: str, text_dir: Path, tokenizer_path: Path) -> None:
    tok = Tokenizer.from_file(tokenizer_path)
    originals = [p.read_text(encoding="utf-8") for p in sorted(text_dir.glob("*.txt"))]
    assert _decoded_docs(tokens_prefix, tok) == originals
    assert IndexedTokens(tokens_prefix).vocab_size == tok.vocab_size


def test_jsonl_input(tmp_path: Path, tokenizer_path: Path) -> None:
    docs = ["first document ✓", "second\nwith newline", "", "  third  "]
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps({"body": d, "id": i}) for i, d in enumerate(docs)) + "\n\n")
    stats = preprocess([str(path)], tokenizer_path, tmp_path / "out", workers=1, json_key="body",
                       show_progress=False)
    assert stats.n_docs == 3  # the empty document is skipped
    assert _decoded_docs(tmp_path / "out", Tokenizer.from_file(tokenizer_path)) == [docs[0], docs[1], docs[3]]


def test_folder_is_recursive_sorted_and_filtered(tmp_path: Path) -> None:
    (tmp_path / "b" / "deep").mkdir(parents=True)
    (tmp_path / "b" / "deep" / "z.md").write_text("z")
    (tmp_path / "b" / "a.py").write_text("a")
    (tmp_path / "a.txt").write_text("top")
    (tmp_path / "skip.bin").write_bytes(b"\x00\x01")
    (tmp_path / "c.jsonl").write_text('{"text": "j1"}\n{"text": "j2"}\n')
    (tmp_path / "empty.txt").write_text("  \n")
    assert list(iter_documents([str(tmp_path)])) == ["top", "a", "z", "j1", "j2"]
    # An explicitly named file is read whatever its suffix.
    (tmp_path / "notes.log").write_text("log text")
    assert list(iter_documents([str(tmp_path / "notes.log")])) == ["log text"]


def test_parallel_output_identical(tmp_path: Path, text_dir: Path, tokenizer_path: Path,
                                   tokens_prefix: str) -> None:
    out = tmp_path / "par"
    preprocess([str(text_dir)], tokenizer_path, out, workers=2, show_progress=False)
    for suffix in (".bin", ".idx"):
        assert Path(f"{out}{suffix}").read_bytes() == Path(tokens_prefix + suffix).read_bytes()


def test_parallel_many_chunks(tmp_path: Path, tokenizer_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tiny chunks force many in-flight tasks: order must still be preserved."""
    import megaloom.data.preprocess as pp

    monkeypatch.setattr(pp, "CHUNK_DOCS", 2)
    docs = [f"document number {i} " * (i % 5 + 1) for i in range(60)]
    path = tmp_path / "many.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    preprocess([str(path)], tokenizer_path, tmp_path / "m", workers=2, show_progress=False)
    assert _decoded_docs(tmp_path / "m", Tokenizer.from_file(tokenizer_path)) == docs


def test_empty_corpus(tmp_path: Path, tokenizer_path: Path) -> None:
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "blank.txt").write_text("\n\n")
    with pytest.raises(DataError, match=r"no documents"):
        preprocess([str(tmp_path / "in")], tokenizer_path, tmp_path / "out", show_progress=False)
    assert not list(tmp_path.glob("out*"))


def test_missing_input(tmp_path: Path, tokenizer_path: Path) -> None:
    with pytest.raises(DataError, match=r"missing_dir"):
        preprocess([str(tmp_path / "missing_dir")], tokenizer_path, tmp_path / "out", show_progress=False)


def test_bad_jsonl(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{oops\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2"):
        list(iter_documents([str(bad)]))
    bad.write_text('{"content": "x"}\n')
    with pytest.raises(DataError, match=r"'text'.*content"):
        list(iter_documents([str(bad)]))


def test_tokens_are_within_vocab(tokens_prefix: str) -> None:
    t = IndexedTokens(tokens_prefix)
    assert int(np.max(t.tokens)) < t.vocab_size
