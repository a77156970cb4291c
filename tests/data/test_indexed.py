from __future__ import annotations

import pickle
import re
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

from megaloom.data.errors import DataError
from megaloom.data.indexed import HEADER, IndexedTokens, resolve_prefix, write_indexed

DOCS = [[1, 2, 3], np.array([4, 5], dtype=np.int32), [], [6]]


def test_write_and_read_back(tmp_path: Path) -> None:
    stats = write_indexed(tmp_path / "t", DOCS, vocab_size=10)
    assert (stats.n_docs, stats.n_tokens, stats.dtype) == (4, 6, "uint16")
    t = IndexedTokens(tmp_path / "t")
    assert (t.n_docs, t.n_tokens, t.vocab_size, t.dtype) == (4, 6, 10, np.uint16)
    assert t.doc_offsets.tolist() == [0, 3, 5, 5, 6]
    assert [t.doc(i).tolist() for i in range(4)] == [[1, 2, 3], [4, 5], [], [6]]
    assert not list(tmp_path.glob(".*tmp*")), "temporary files left behind"


def test_dtype_follows_vocab_size(tmp_path: Path) -> None:
    write_indexed(tmp_path / "a", [[65535]], vocab_size=65536)
    write_indexed(tmp_path / "b", [[70000]], vocab_size=70001)
    assert IndexedTokens(tmp_path / "a").dtype == np.uint16
    b = IndexedTokens(tmp_path / "b")
    assert b.dtype == np.uint32 and b.tokens.tolist() == [70000]


def test_out_of_range_ids_rejected(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"outside"):
        write_indexed(tmp_path / "t", [[1, 10]], vocab_size=10)
    assert not list(tmp_path.iterdir()), "a failed write must leave no files"


def test_suffixes_accepted(tmp_path: Path) -> None:
    write_indexed(tmp_path / "t", DOCS, vocab_size=10)
    assert resolve_prefix(tmp_path / "t.bin") == str(tmp_path / "t")
    assert resolve_prefix(f"{tmp_path}/t.idx") == str(tmp_path / "t")
    assert IndexedTokens(f"{tmp_path}/t.bin").n_tokens == 6


def test_pickles_by_path(tmp_path: Path) -> None:
    write_indexed(tmp_path / "t", DOCS, vocab_size=10)
    t = pickle.loads(pickle.dumps(IndexedTokens(tmp_path / "t")))
    assert t.tokens.tolist() == [1, 2, 3, 4, 5, 6]
    assert len(pickle.dumps(t)) < 200


@pytest.fixture
def copy(tmp_path: Path, tokens_prefix: str) -> Path:
    for suffix in (".bin", ".idx"):
        shutil.copy(tokens_prefix + suffix, tmp_path / f"c{suffix}")
    return tmp_path / "c"


def test_truncated_bin(copy: Path) -> None:
    bin_path = copy.with_suffix(".bin")
    bin_path.write_bytes(bin_path.read_bytes()[:-2])
    with pytest.raises(DataError, match=rf"{re.escape(str(bin_path))}.*truncated.*megaloom preprocess"):
        IndexedTokens(copy)


def test_missing_idx(copy: Path) -> None:
    copy.with_suffix(".idx").unlink()
    with pytest.raises(DataError, match=re.escape(f"{copy}.idx does not exist")):
        IndexedTokens(copy)


def test_missing_bin(copy: Path) -> None:
    copy.with_suffix(".bin").unlink()
    with pytest.raises(DataError, match=re.escape(f"{copy}.bin does not exist")):
        IndexedTokens(copy)


def _patch_header(idx: Path, **fields: object) -> None:
    raw = idx.read_bytes()
    values = dict(zip(("magic", "version", "code", "vocab", "n_docs"), HEADER.unpack(raw[:HEADER.size]),
                      strict=True))
    values.update(fields)
    idx.write_bytes(HEADER.pack(*values.values()) + raw[HEADER.size:])


def test_bad_magic(copy: Path) -> None:
    _patch_header(copy.with_suffix(".idx"), magic=b"NOTMAGIC")
    with pytest.raises(DataError, match=rf"{re.escape(str(copy))}\.idx.*MLOOMIDX"):
        IndexedTokens(copy)


def test_bad_version(copy: Path) -> None:
    _patch_header(copy.with_suffix(".idx"), version=7)
    with pytest.raises(DataError, match=r"version 7"):
        IndexedTokens(copy)


def test_truncated_idx(copy: Path) -> None:
    idx = copy.with_suffix(".idx")
    idx.write_bytes(idx.read_bytes()[:-8])
    with pytest.raises(DataError, match=re.escape(f"{idx} is truncated")):
        IndexedTokens(copy)


def test_offsets_not_monotone(copy: Path) -> None:
    idx = copy.with_suffix(".idx")
    raw = bytearray(idx.read_bytes())
    struct.pack_into("<q", raw, HEADER.size + 8, 10**6)  # offsets[1] far beyond offsets[2]
    idx.write_bytes(bytes(raw))
    with pytest.raises(DataError, match=r"offsets"):
        IndexedTokens(copy)


def test_empty_token_file(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"no tokens"):
        write_indexed(tmp_path / "e", [[], []], vocab_size=10)
    (tmp_path / "e.bin").write_bytes(b"")
    (tmp_path / "e.idx").write_bytes(HEADER.pack(b"MLOOMIDX", 1, 1, 10, 0) + struct.pack("<q", 0))
    with pytest.raises(DataError, match=r"empty"):
        IndexedTokens(tmp_path / "e")
