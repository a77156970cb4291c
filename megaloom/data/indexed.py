"""Memory-mapped token files: ``prefix.bin`` holds raw token ids, ``prefix.idx`` where documents start.

``.idx`` layout (little-endian): magic ``b"MLOOMIDX"``, format version (uint32), dtype code (uint8),
vocab_size (uint64), n_docs (uint64), then n_docs + 1 int64 document offsets counted in tokens.
Token ids are stored as uint16 whenever the vocabulary fits, halving disk and page-cache use.

Megatron-LM's ``.bin``/``.idx`` pairs (magic ``MMIDIDX``) open through the same class, read in place
(`megaloom.data.megatron`): data.paths may name either kind, and blends mix them.
"""

from __future__ import annotations

import os
import struct
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megaloom.data.cache import tmp_name
from megaloom.data.errors import DataError
from megaloom.data.megatron import DTYPES as MEGATRON_DTYPES
from megaloom.data.megatron import FIX as MEGATRON_FIX
from megaloom.data.megatron import HEADER as MEGATRON_HEADER
from megaloom.data.megatron import is_megatron_index, read_megatron_index

MAGIC = b"MLOOMIDX"
VERSION = 1
HEADER = struct.Struct("<8sIBQQ")
DTYPES: dict[int, np.dtype] = {1: np.dtype(np.uint16), 2: np.dtype(np.uint32)}
FIX = "re-run `megaloom preprocess` to rebuild it"


@dataclass
class IndexStats:
    """What ``write_indexed`` produced, for progress messages and tests."""

    n_docs: int
    n_tokens: int
    dtype: str
    seconds: float


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """The narrowest stored dtype that holds every id of a ``vocab_size`` vocabulary."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def resolve_prefix(path: str | Path) -> str:
    """Accept ``prefix``, ``prefix.bin`` or ``prefix.idx`` and return ``prefix``."""
    s = str(Path(path).expanduser())
    return s[:-4] if s.endswith((".bin", ".idx")) else s


def write_indexed(prefix: str | Path, docs: Iterable[Sequence[int] | np.ndarray],
                  vocab_size: int) -> IndexStats:
    """Stream ``docs`` (token-id sequences) into ``prefix.bin``/``prefix.idx``.

    Both files are written under temporary names and moved into place at the end, ``.idx`` last, so
    a crash never leaves a complete-looking pair; the per-doc arrays are written as they arrive.
    """
    t0 = time.perf_counter()
    prefix = resolve_prefix(prefix)
    bin_path, idx_path = Path(prefix + ".bin"), Path(prefix + ".idx")
    bin_path.parent.mkdir(parents=True, exist_ok=True)
    dtype = dtype_for_vocab(vocab_size)
    code = next(c for c, d in DTYPES.items() if d == dtype)
    bin_tmp, idx_tmp = tmp_name(bin_path), tmp_name(idx_path)
    offsets = [0]
    try:
        with open(bin_tmp, "wb") as f:
            for i, doc in enumerate(docs):
                arr = np.asarray(doc)
                if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
                    raise DataError(f"document {i} for {bin_path} is not a 1-D sequence of integer token ids "
                                    f"(got dtype {arr.dtype}, shape {arr.shape})")
                if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= vocab_size):
                    raise DataError(f"document {i} for {bin_path} has token ids outside [0, {vocab_size}) "
                                    f"(min {arr.min()}, max {arr.max()}); the tokenizer and vocab_size "
                                    "disagree")
                f.write(arr.astype(dtype, copy=False).tobytes())
                offsets.append(offsets[-1] + arr.size)
        n_docs, n_tokens = len(offsets) - 1, offsets[-1]
        if n_tokens == 0:
            raise DataError(f"no tokens to write to {bin_path} ({n_docs} documents, all empty); "
                            "check that the input corpus contains text")
        with open(idx_tmp, "wb") as f:
            f.write(HEADER.pack(MAGIC, VERSION, code, vocab_size, n_docs))
            f.write(np.asarray(offsets, dtype="<i8").tobytes())
        os.replace(bin_tmp, bin_path)
        os.replace(idx_tmp, idx_path)
    finally:
        bin_tmp.unlink(missing_ok=True)
        idx_tmp.unlink(missing_ok=True)
    return IndexStats(n_docs, n_tokens, dtype.name, time.perf_counter() - t0)


def index_counts(prefix: str | Path) -> tuple[int, int]:
    """(documents, tokens) from a ``.idx``'s header and last entries (megaloom's or Megatron's), reading a few bytes;
    the files are validated when the data loads."""
    path = Path(resolve_prefix(prefix) + ".idx")
    with open(path, "rb") as f:
        if not is_megatron_index(path):
            n_docs = HEADER.unpack(f.read(HEADER.size))[4]
            f.seek(HEADER.size + 8 * n_docs)  # the last document offset: the token count
            return int(n_docs), int.from_bytes(f.read(8), "little", signed=True)
        _, _, code, n_seq, n_doc_idx = MEGATRON_HEADER.unpack(f.read(MEGATRON_HEADER.size))
        if n_seq == 0:
            return max(int(n_doc_idx) - 1, 0), 0
        f.seek(MEGATRON_HEADER.size + 4 * (n_seq - 1))
        last_len = int.from_bytes(f.read(4), "little", signed=True)
        f.seek(MEGATRON_HEADER.size + 4 * n_seq + 8 * (n_seq - 1))
        last_ptr = int.from_bytes(f.read(8), "little", signed=True)
        itemsize = np.dtype(MEGATRON_DTYPES.get(code, np.uint8)).itemsize
        return max(int(n_doc_idx) - 1, 0), last_ptr // itemsize + last_len


def _increasing(offsets: np.ndarray, chunk: int = 1 << 22) -> bool:
    """Offsets never decrease, checked a chunk at a time (bounded memory for any index size)."""
    for lo in range(0, len(offsets) - 1, chunk):
        part = np.asarray(offsets[lo:lo + chunk + 1])
        if np.any(part[1:] < part[:-1]):
            return False
    return True


class IndexedTokens:
    """Read-only, memory-mapped view of a ``prefix.bin``/``prefix.idx`` pair, validated on open."""

    def __init__(self, prefix: str | Path) -> None:
        self.prefix = resolve_prefix(prefix)
        self.bin_path, self.idx_path = Path(self.prefix + ".bin"), Path(self.prefix + ".idx")
        for p in (self.bin_path, self.idx_path):
            if not p.is_file():
                raise DataError(f"token file {p} does not exist (from data.paths entry {self.prefix!r}); "
                                f"check the path or {FIX}")
        # "megaloom" or "megatron" (Megatron-LM's MMIDIDX files: no vocabulary in the header, vocab_size 0)
        self.format = "megatron" if is_megatron_index(self.idx_path) else "megaloom"
        if self.format == "megatron":
            self.dtype, self.doc_offsets = read_megatron_index(self.idx_path, self.bin_path)
            self.vocab_size = 0
        else:
            self.dtype, self.vocab_size, self.doc_offsets = self._read_index()
        self.n_docs = len(self.doc_offsets) - 1
        self.n_tokens = int(self.doc_offsets[-1])
        fix = FIX if self.format == "megaloom" else MEGATRON_FIX
        if self.n_tokens == 0:
            raise DataError(f"token file {self.bin_path} is empty (0 tokens in {self.n_docs} documents); "
                            f"{fix} on a corpus that contains text")
        expected = self.n_tokens * self.dtype.itemsize
        actual = self.bin_path.stat().st_size
        if actual != expected:
            raise DataError(f"token file {self.bin_path} has {actual} bytes but {self.idx_path} describes "
                            f"{self.n_tokens} {self.dtype.name} tokens ({expected} bytes): it is truncated "
                            f"or belongs to another index; {fix}")
        self.tokens = np.memmap(self.bin_path, dtype=self.dtype, mode="r")

    def _read_index(self) -> tuple[np.dtype, int, np.ndarray]:
        path = self.idx_path
        with open(path, "rb") as f:
            head = f.read(HEADER.size)
            if len(head) < HEADER.size:
                raise DataError(f"index file {path} is too short for a header ({len(head)} bytes); {FIX}")
            magic, version, code, vocab_size, n_docs = HEADER.unpack(head)
            if magic != MAGIC:
                raise DataError(f"index file {path} does not start with {MAGIC!r} (found {magic!r}): "
                                f"not a megaloom index; {FIX}")
            if version != VERSION:
                raise DataError(f"index file {path} has format version {version}, this megaloom reads "
                                f"version {VERSION}; {FIX}")
            if code not in DTYPES:
                raise DataError(f"index file {path} has unknown dtype code {code}; {FIX}")
        # Memory-mapped, never read whole: at 1T tokens the offsets alone are GBs, and every rank shares the pages.
        available = (path.stat().st_size - HEADER.size) // 8
        if available < n_docs + 1:
            raise DataError(f"index file {path} is truncated: header says {n_docs} documents but it holds "
                            f"{max(available - 1, 0)} offsets; {FIX}")
        offsets = np.memmap(path, dtype="<i8", mode="r", offset=HEADER.size, shape=(n_docs + 1,))
        if offsets[0] != 0 or not _increasing(offsets):
            raise DataError(f"index file {path} has document offsets that do not start at 0 and increase; "
                            f"it is corrupt; {FIX}")
        return DTYPES[code], int(vocab_size), offsets

    def fix(self) -> str:
        """How to rebuild these files (the end of a DataError about them)."""
        return FIX if self.format == "megaloom" else MEGATRON_FIX

    def doc(self, i: int) -> np.ndarray:
        """Tokens of document ``i`` (a memmap slice; copy it if you keep it)."""
        if not 0 <= i < self.n_docs:
            raise IndexError(f"document {i} out of range for {self.prefix} ({self.n_docs} documents)")
        return self.tokens[self.doc_offsets[i]:self.doc_offsets[i + 1]]

    # Pickle by path: DataLoader workers started with spawn would otherwise copy the whole memmap.
    def __getstate__(self) -> dict:
        return {"prefix": self.prefix}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["prefix"])

    def __repr__(self) -> str:
        return f"IndexedTokens({self.prefix!r}, n_docs={self.n_docs}, n_tokens={self.n_tokens})"
