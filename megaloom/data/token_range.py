"""Token ids beyond the vocabulary, found at load time rather than as an IndexError (a device assert on GPUs) in
the embedding at step 1.

A `.bin` whose header is valid can still hold ids the index's vocabulary does not have (a file damaged on disk,
or written by another tool). The largest id of each file is computed once, vectorised over the memory map in
fixed-size chunks (memory stays bounded whatever the file's size), and cached beside the shuffled indices, keyed
on the file's path, size and modification time, so later runs pay nothing.
"""

from __future__ import annotations

import bisect
import json
import os
from pathlib import Path

import numpy as np

from megaloom.data.cache import short_hash, tmp_name
from megaloom.data.errors import DataError
from megaloom.data.indexed import FIX, IndexedTokens

CHUNK_TOKENS = 1 << 24  # 32 MiB of uint16 per read


def largest_token_id(tokens: IndexedTokens, chunk: int = CHUNK_TOKENS) -> int:
    return token_id_range(tokens, chunk)[1]


def token_id_range(tokens: IndexedTokens, chunk: int = CHUNK_TOKENS) -> tuple[int, int]:
    """(smallest, largest) token id of the file, a chunk at a time."""
    arr = tokens.tokens
    parts = [(int(arr[i:i + chunk].min()), int(arr[i:i + chunk].max())) for i in range(0, len(arr), chunk)]
    return min(p[0] for p in parts), max(p[1] for p in parts)


def _first(tokens: IndexedTokens, bad, chunk: int = CHUNK_TOKENS) -> int:
    """The position of the first token for which ``bad(array chunk)`` holds."""
    arr = tokens.tokens
    for i in range(0, len(arr), chunk):
        hits = np.flatnonzero(bad(arr[i:i + chunk]))
        if hits.size:
            return i + int(hits[0])
    raise AssertionError("no such token")


def _cache_file(folder: Path, tokens: IndexedTokens) -> Path:
    st = tokens.bin_path.stat()
    key = short_hash(str(Path(tokens.prefix).resolve()), st.st_size, st.st_mtime_ns, "max-token-id")
    return folder / f"{Path(tokens.prefix).name}-maxid-{key}.json"


def _cached_range(folder: Path | None, tokens: IndexedTokens) -> tuple[int, int]:
    path = _cache_file(folder, tokens) if folder is not None else None
    if path is not None:
        try:
            record = json.loads(path.read_text())
            return int(record.get("min_id", 0)), int(record["max_id"])  # files before min_id: unsigned dtypes
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass  # missing or unreadable: computed again
    smallest, largest = token_id_range(tokens)
    if path is not None:
        tmp = tmp_name(path)
        try:
            tmp.write_text(json.dumps({"max_id": largest, "min_id": smallest, "file": str(tokens.bin_path)}))
            os.replace(tmp, path)
        except OSError:
            tmp.unlink(missing_ok=True)  # a cache that cannot be written only costs the next run the scan
    return smallest, largest


def check_token_ids(tokens: IndexedTokens, cache_folder: Path | None, tokenizer_vocab: int) -> None:
    """Every id of ``tokens`` must be in [0, its index's vocab_size) (which does not exceed the tokenizer's, nor
    therefore model.vocab_size; an index without one, Megatron's, is held to the tokenizer's): otherwise a
    DataError naming the file, the first bad position and the fix."""
    smallest, largest = _cached_range(cache_folder, tokens)
    limit = tokens.vocab_size or tokenizer_vocab
    if 0 <= smallest and largest < limit:
        return
    pos = _first(tokens, lambda a: (a < 0) | (a >= limit))
    doc = bisect.bisect_right(tokens.doc_offsets, pos) - 1
    found = (f"token file {tokens.bin_path} holds token id {int(tokens.tokens[pos])} (first at token {pos}, "
             f"document {doc}; ids from {smallest} to {largest})")
    if tokens.vocab_size:
        raise DataError(f"{found} but its index {tokens.idx_path} declares a vocabulary of {tokens.vocab_size} (the "
                        f"tokenizer has {tokenizer_vocab}; model.vocab_size must exceed every id): the file is "
                        f"damaged or was not written for this vocabulary; {FIX}")
    raise DataError(f"{found} but the tokenizer has a vocabulary of {tokenizer_vocab}: set data.tokenizer to the "
                    f"tokenizer these files were made with (Megatron-LM's index does not record it), or "
                    f"{tokens.fix()}")
