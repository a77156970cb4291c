"""Megatron-LM's MMIDIDX token files read in place: documents of several sequences, the dtype from the header,
blending with megaloom's own files, the checkpoint's data identity, and one clear line for each malformed file."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

from megaloom.data.dataset import build_datasets
from megaloom.data.errors import DataError
from megaloom.data.identity import dataset_identity
from megaloom.data.indexed import IndexedTokens
from megaloom.data.tokenizer import Tokenizer

CODES = {np.uint8: 1, np.int8: 2, np.int16: 3, np.int32: 4, np.int64: 5, np.float64: 6, np.float32: 7, np.uint16: 8}


def write_megatron(prefix: Path, docs: list[list[list[int]]], dtype=np.uint16, modes: bool = False) -> Path:
    """A .bin/.idx pair as Megatron-Core's IndexedDatasetBuilder writes it (written here from the format's
    description: header, int32 sequence lengths, int64 byte pointers, int64 document indices); ``docs``: documents
    as lists of sequences of token ids."""
    seqs = [s for d in docs for s in d]
    itemsize = np.dtype(dtype).itemsize
    pointers = np.concatenate(([0], np.cumsum([len(s) * itemsize for s in seqs])[:-1])).astype("<i8")
    doc_indices = np.concatenate(([0], np.cumsum([len(d) for d in docs]))).astype("<i8")
    prefix.with_suffix(".bin").write_bytes(b"".join(np.asarray(s, dtype=dtype).tobytes() for s in seqs))
    with open(prefix.with_suffix(".idx"), "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", CODES[dtype]))
        f.write(struct.pack("<Q", len(seqs)) + struct.pack("<Q", len(doc_indices)))
        f.write(np.asarray([len(s) for s in seqs], dtype="<i4").tobytes() + pointers.tobytes() + doc_indices.tobytes())
        if modes:
            f.write(np.zeros(len(seqs), dtype=np.int8).tobytes())
    return prefix


def corpus(n_docs: int, eod: int, seed: int = 0) -> list[list[list[int]]]:
    """Documents of 1-3 sequences (sentences), the last ending with the EOD token (preprocess_data --append-eod)."""
    rng = np.random.default_rng(seed)
    docs = []
    for _ in range(n_docs):
        doc = [rng.integers(3, 250, rng.integers(5, 40)).tolist() for _ in range(rng.integers(1, 4))]
        doc[-1].append(eod)
        docs.append(doc)
    return docs


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_megatron_files_read_documents_of_several_sequences(tmp_path: Path, dtype) -> None:
    docs = corpus(30, eod=0)
    t = IndexedTokens(write_megatron(tmp_path / "mega", docs, dtype))
    assert (t.format, t.dtype, t.vocab_size, t.n_docs) == ("megatron", np.dtype(dtype), 0, 30)
    assert t.n_tokens == sum(len(s) for d in docs for s in d)
    for i in (0, 7, 29):
        assert t.doc(i).tolist() == [tok for s in docs[i] for tok in s]
    flat = [tok for d in docs for s in d for tok in s]
    assert t.tokens.tolist() == flat
    starts = np.cumsum([0] + [sum(len(s) for s in d) for d in docs])
    np.testing.assert_array_equal(t.doc_offsets[0:31], starts)
    ident = dataset_identity(t.prefix)  # what a checkpoint records of its data
    assert (ident["docs"], ident["tokens"]) == (30, t.n_tokens)


def test_megatron_and_megaloom_files_blend(tmp_path: Path, make_cfg, tokens_prefix: str,
                                           tokenizer_path: Path) -> None:
    """data.paths naming a megaloom and a Megatron file: every sample is a window of one of the two streams, both
    in the proportion data.weights asks for."""
    eod = Tokenizer.from_file(tokenizer_path).eod_id
    mega = write_megatron(tmp_path / "mega", corpus(60, eod), np.int32)
    cfg = make_cfg(paths=[tokens_prefix, str(mega)], weights=[0.5, 0.5], split="90,10")
    train, valid, _ = build_datasets(cfg, seq_len=16, seed=3, n_train=40, n_valid=4)
    windows = [np.lib.stride_tricks.sliding_window_view(np.asarray(IndexedTokens(p).tokens, dtype=np.int64), 17)
               for p in (tokens_prefix, mega)]
    sources = []
    for i in range(len(train)):
        found = [int((w == np.asarray(train[i])).all(1).any()) for w in windows]
        assert sum(found) == 1, (i, found)  # a window of exactly one of the two token streams
        sources.append(found.index(1))
    assert sources.count(1) == 20 and len(valid) == 4


def test_token_ids_are_checked_against_the_tokenizer(tmp_path: Path, make_cfg) -> None:
    big = write_megatron(tmp_path / "big", [[[5, 6, 7, 9999, 1]]] * 8, np.int32)
    with pytest.raises(DataError, match=r"holds token id 9999.*tokenizer has a vocabulary of 300: set data\.tokenizer"):
        build_datasets(make_cfg(paths=[str(big)], split="50,50"), seq_len=4, seed=0, n_train=2, n_valid=1)
    neg = write_megatron(tmp_path / "neg", [[[5, 6, -3, 9, 1]]] * 8, np.int32)
    with pytest.raises(DataError, match="holds token id -3"):
        build_datasets(make_cfg(paths=[str(neg)], split="50,50"), seq_len=4, seed=0, n_train=2, n_valid=1)


def _patch(path: Path, offset: int, data: bytes) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset:offset + len(data)] = data
    path.write_bytes(bytes(raw))


def _malformed(tmp_path: Path, kind: str) -> Path:
    docs = [[[1, 2, 3], [4, 5]], [[6, 7, 8, 9]], [[10]]]  # 4 sequences, 3 documents
    prefix = write_megatron(tmp_path / "bad", docs, np.float32 if kind == "float" else np.uint16,
                            modes=kind == "modes")
    idx, bin_ = prefix.with_suffix(".idx"), prefix.with_suffix(".bin")
    lengths, pointers, doc_idx = 34, 34 + 4 * 4, 34 + 12 * 4
    if kind == "version":
        _patch(idx, 9, struct.pack("<Q", 2))
    elif kind == "code":
        _patch(idx, 17, struct.pack("<B", 11))
    elif kind == "truncated":
        idx.write_bytes(idx.read_bytes()[:-8])
    elif kind == "documents":
        _patch(idx, doc_idx + 8, struct.pack("<q", 3))  # [0, 2, 3, 4] -> [0, 3, 1, 4]
        _patch(idx, doc_idx + 16, struct.pack("<q", 1))
    elif kind == "gap":
        _patch(idx, pointers + 16, struct.pack("<q", 12))  # sequence 2 should start at byte 10
    elif kind == "negative":
        _patch(idx, lengths + 4, struct.pack("<i", -2))
    elif kind == "bin":
        bin_.write_bytes(bin_.read_bytes()[:-2])
    return prefix


@pytest.mark.parametrize("kind,message", [
    ("version", r"has version 2 \(megaloom reads MMIDIDX version 1\)"),
    ("float", "stores float32 values, not token ids"),
    ("code", "unknown dtype code 11"),
    ("truncated", "is truncated or corrupt"),
    ("modes", "per-sequence modes"),
    ("documents", "document indices that do not run from 0"),
    ("gap", "puts sequence 2 at byte 12 of the .bin, where the sequences before it end at byte 10"),
    ("negative", "gives sequence 1 a negative length"),
    ("bin", r"has 18 bytes but .* describes 10 uint16 tokens \(20 bytes\)"),
])
def test_malformed_megatron_files_are_refused_in_one_line(tmp_path: Path, kind: str, message: str) -> None:
    prefix = _malformed(tmp_path, kind)
    with pytest.raises(DataError, match=message) as err:
        IndexedTokens(prefix)
    assert "\n" not in str(err.value) and "preprocess_data.py" in str(err.value)


def test_files_written_by_megatron_core_itself(tmp_path: Path) -> None:
    """The same reading of files Megatron-Core's own builder writes (runs where megatron-core is installed)."""
    torch = pytest.importorskip("torch")
    builder = pytest.importorskip("megatron.core.datasets.indexed_dataset").IndexedDatasetBuilder
    b = builder(str(tmp_path / "mc.bin"), dtype=np.int32)
    docs = corpus(20, eod=0)
    for doc in docs:
        for seq in doc:
            b.add_item(torch.tensor(seq))
        b.end_document()
    b.finalize(str(tmp_path / "mc.idx"))
    t = IndexedTokens(tmp_path / "mc")
    assert (t.format, t.n_docs) == ("megatron", 20)
    assert all(t.doc(i).tolist() == [tok for s in docs[i] for tok in s] for i in range(20))
