"""Token ids beyond the vocabulary, found at load time rather than as an IndexError (a device assert on GPUs) in
the embedding at step 1.

A `.bin` whose header is valid can still hold ids the index's vocabulary does not have (a file damaged on disk,
or written by another tool). The largest id of each file is computed once, vectorised over the memory map in
fixed-size chunks (memory stays bounded whatever the file's size), and cached beside the shuffled indices, keyed
on the file's path, size and modification time, so later runs pay nothing.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from megaloom.data.cache import short_hash, tmp_name
from megaloom.data.errors import DataError
from megaloom.data.indexed import FIX, IndexedTokens

CHUNK_TOKENS = 1 << 24  # 32 MiB of uint16 per read


def largest_token_id(tokens: IndexedTokens, chunk: int = CHUNK_TOKENS) -> int:
    arr = tokens.tokens
    return max(int(arr[i:i + chunk].max()) for i in range(0, len(arr), chunk))


def _first_at_or_above(tokens: IndexedTokens, limit: int, chunk: int = CHUNK_TOKENS) -> int:
    arr = tokens.tokens
    for i in range(0, len(arr), chunk):
        hits = np.flatnonzero(arr[i:i + chunk] >= limit)
        if hits.size:
            return i + int(hits[0])
    raise AssertionError("no id at or above the limit")


def _cache_file(folder: Path, tokens: IndexedTokens) -> Path:
    st = tokens.bin_path.stat()
    key = short_hash(str(Path(tokens.prefix).resolve()), st.st_size, st.st_mtime_ns, "max-token-id")
    return folder / f"{Path(tokens.prefix).name}-maxid-{key}.json"


def _cached_max(folder: Path | None, tokens: IndexedTokens) -> int:
    path = _cache_file(folder, tokens) if folder is not None else None
    if path is not None:
        try:
            return int(json.loads(path.read_text())["max_id"])
        except (OSError, ValueError, KeyError, TypeError):
            pass  # missing or unreadable: computed again
    largest = largest_token_id(tokens)
    if path is not None:
        tmp = tmp_name(path)
        try:
            tmp.write_text(json.dumps({"max_id": largest, "file": str(tokens.bin_path)}))
            os.replace(tmp, path)
        except OSError:
            tmp.unlink(missing_ok=True)  # a cache that cannot be written only costs the next run the scan
    return largest


def check_token_ids(tokens: IndexedTokens, cache_folder: Path | None, tokenizer_vocab: int) -> None:
    """Every id of ``tokens`` must be below its index's vocab_size (which does not exceed the tokenizer's, nor
    therefore model.vocab_size): otherwise a DataError naming the file, the first bad position and the fix."""
    largest = _cached_max(cache_folder, tokens)
    if largest < tokens.vocab_size:
        return
    pos = _first_at_or_above(tokens, tokens.vocab_size)
    doc = int(np.searchsorted(tokens.doc_offsets, pos, side="right")) - 1
    raise DataError(f"token file {tokens.bin_path} holds token id {int(tokens.tokens[pos])} (first at token {pos}, "
                    f"document {doc}; largest {largest}) but its index {tokens.idx_path} declares a vocabulary of "
                    f"{tokens.vocab_size} (the tokenizer has {tokenizer_vocab}; model.vocab_size must exceed every "
                    f"id): the file is damaged or was not written for this vocabulary; {FIX}")
