"""Megatron-LM's token files (``MMIDIDX``), read in place: the ``.bin``/``.idx`` pairs that Megatron-LM's
``tools/preprocess_data.py`` (and the many corpora prepared for Megatron-style trainers) write.

``.idx`` layout (little-endian), as Megatron-Core's ``indexed_dataset._IndexWriter`` writes it: magic
``b"MMIDIDX\\x00\\x00"`` (9 bytes), version (uint64, 1), dtype code (uint8: 1 uint8, 2 int8, 3 int16, 4 int32,
5 int64, 6 float64, 7 float32, 8 uint16), sequence count S (uint64), document-index count D (uint64), then S
int32 sequence lengths (tokens), S int64 sequence pointers (byte offsets into ``.bin``), D int64 document indices
(the sequence where each document starts, from 0 to S: D = documents + 1), and, only in multimodal datasets, S
int8 sequence modes. A document is one or more sequences (several with ``--split-sentences``).

megaloom reads the ``.bin`` as one token stream, as it reads its own files: documents are packed across sample
boundaries (Megatron's GPTDataset does the same), so what it needs is where each document starts, in tokens. The
sequences of a well-formed file lie back to back (each pointer is the previous one plus its length in bytes), which
opening checks a chunk at a time; a document's start is then its first sequence's pointer / the token size, read
through the memory map when asked (`DocOffsets`), never copied into private memory. Refused, each in one line naming
the file: another magic or version, a float or unknown dtype, counts that do not fit the file's size, multimodal
modes, document indices that do not run from 0 to S without decreasing, negative lengths, pointers that leave gaps
or overlap, and a ``.bin`` whose size is not the tokens the index describes.

The index carries no vocabulary: the tokenizer is data.tokenizer (the one the files were made with), and the token
ids are checked against it when the data loads (`megaloom.data.token_range`). Documents end with an EOD token only
if preprocess_data.py ran with ``--append-eod`` (what GPT pretraining uses); data.document_mask and
data.reset_positions find documents by that token.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

from megaloom.data.errors import DataError

MAGIC = b"MMIDIDX\x00\x00"
HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document-index count: 34 bytes
DTYPES: dict[int, np.dtype] = {1: np.dtype(np.uint8), 2: np.dtype(np.int8), 3: np.dtype(np.int16),
                               4: np.dtype(np.int32), 5: np.dtype(np.int64), 8: np.dtype(np.uint16)}
FLOATS = {6: "float64", 7: "float32"}
FIX = "re-create it with Megatron-LM's tools/preprocess_data.py, or tokenize the text with `megaloom preprocess`"
CHUNK = 1 << 22


def is_megatron_index(path: str | Path) -> bool:
    """Whether ``path`` starts with Megatron's MMIDIDX magic."""
    with open(path, "rb") as f:
        return f.read(len(MAGIC)) == MAGIC


class DocOffsets:
    """Where each document starts in the token stream (n_docs + 1 values, the last the token count), computed from
    the memory-mapped document indices and sequence pointers when read: indexable by an int or a slice, like the
    offsets array of megaloom's own index."""

    def __init__(self, doc_indices: np.ndarray, pointers: np.ndarray, itemsize: int, n_tokens: int) -> None:
        self.doc_indices, self.pointers, self.itemsize, self.n_tokens = doc_indices, pointers, itemsize, n_tokens

    def __len__(self) -> int:
        return len(self.doc_indices)

    def _starts(self, seq: np.ndarray) -> np.ndarray:
        out = np.full(seq.shape, self.n_tokens, dtype=np.int64)
        inside = seq < len(self.pointers)
        out[inside] = np.asarray(self.pointers[seq[inside]]) // self.itemsize
        return out

    def __getitem__(self, i):
        if isinstance(i, slice):
            return self._starts(np.asarray(self.doc_indices[i]))
        return int(self._starts(np.asarray([self.doc_indices[i]]))[0])


def read_megatron_index(idx_path: Path, bin_path: Path) -> tuple[np.dtype, DocOffsets]:
    """(token dtype, document offsets in tokens) of a Megatron ``.idx``, validated against its ``.bin``'s size;
    a DataError names the file and what is wrong."""
    size = idx_path.stat().st_size
    with open(idx_path, "rb") as f:
        head = f.read(HEADER.size)
    if len(head) < HEADER.size:
        raise DataError(f"Megatron index {idx_path} is too short for its header ({len(head)} of {HEADER.size} "
                        f"bytes); {FIX}")
    magic, version, code, n_seq, n_doc_idx = HEADER.unpack(head)
    if magic != MAGIC or version != 1:
        raise DataError(f"Megatron index {idx_path} has version {version} (megaloom reads MMIDIDX version 1); {FIX}")
    if code in FLOATS:
        raise DataError(f"Megatron index {idx_path} stores {FLOATS[code]} values, not token ids (dtype code {code}); "
                        f"megaloom trains on integer token files; {FIX}")
    if code not in DTYPES:
        raise DataError(f"Megatron index {idx_path} has unknown dtype code {code} (known: 1-8); {FIX}")
    dtype = DTYPES[code]
    body = n_seq * (4 + 8) + n_doc_idx * 8
    if size == HEADER.size + body + n_seq and n_seq:
        raise DataError(f"Megatron index {idx_path} has per-sequence modes (a multimodal dataset); megaloom reads "
                        f"text-only token files: {FIX}, from the text alone")
    if size != HEADER.size + body:
        raise DataError(f"Megatron index {idx_path} is {size} bytes but its header describes {n_seq} sequences and "
                        f"{n_doc_idx} document indices ({HEADER.size + body} bytes): it is truncated or corrupt; {FIX}")
    if n_doc_idx < 1:
        raise DataError(f"Megatron index {idx_path} has no document indices (a well-formed file starts them at 0); "
                        f"{FIX}")
    lengths = np.memmap(idx_path, dtype="<i4", mode="r", offset=HEADER.size, shape=(n_seq,)) if n_seq else \
        np.zeros(0, dtype="<i4")
    pointers = np.memmap(idx_path, dtype="<i8", mode="r", offset=HEADER.size + 4 * n_seq, shape=(n_seq,)) if n_seq \
        else np.zeros(0, dtype="<i8")
    docs = np.memmap(idx_path, dtype="<i8", mode="r", offset=HEADER.size + 12 * n_seq, shape=(n_doc_idx,))
    if docs[0] != 0 or docs[-1] != n_seq or not _never_decreasing(docs):
        raise DataError(f"Megatron index {idx_path} has document indices that do not run from 0 to its {n_seq} "
                        f"sequences without decreasing (first {int(docs[0])}, last {int(docs[-1])}): it is corrupt; "
                        f"{FIX}")
    _check_back_to_back(idx_path, lengths, pointers, dtype.itemsize)
    n_tokens = (int(pointers[-1]) // dtype.itemsize + int(lengths[-1])) if n_seq else 0
    expected = n_tokens * dtype.itemsize
    actual = bin_path.stat().st_size
    if actual != expected:
        raise DataError(f"token file {bin_path} has {actual} bytes but {idx_path} describes {n_tokens} {dtype.name} "
                        f"tokens ({expected} bytes): it is truncated or belongs to another index; {FIX}")
    return dtype, DocOffsets(docs, pointers, dtype.itemsize, n_tokens)


def _never_decreasing(a: np.ndarray) -> bool:
    for lo in range(0, len(a) - 1, CHUNK):
        part = np.asarray(a[lo:lo + CHUNK + 1])
        if np.any(part[1:] < part[:-1]):
            return False
    return True


def _check_back_to_back(idx_path: Path, lengths: np.ndarray, pointers: np.ndarray, itemsize: int) -> None:
    """Sequence i starts where sequence i - 1 ends (the first at byte 0), checked a chunk at a time."""
    expected_next = 0
    for lo in range(0, len(lengths), CHUNK):
        ln = np.asarray(lengths[lo:lo + CHUNK], dtype=np.int64)
        ptr = np.asarray(pointers[lo:lo + CHUNK])
        if ln.size and ln.min() < 0:
            i = lo + int(np.argmax(ln < 0))
            raise DataError(f"Megatron index {idx_path} gives sequence {i} a negative length ({int(lengths[i])}): "
                            f"it is corrupt; {FIX}")
        starts = expected_next + np.concatenate(([0], np.cumsum(ln[:-1] * itemsize)))
        bad = np.flatnonzero(ptr != starts)
        if bad.size:
            i = lo + int(bad[0])
            raise DataError(f"Megatron index {idx_path} puts sequence {i} at byte {int(pointers[i])} of the .bin, "
                            f"where the sequences before it end at byte {int(starts[bad[0]])}: sequences that leave "
                            f"gaps or overlap are not read; {FIX}")
        expected_next = int(starts[-1] + ln[-1] * itemsize)
