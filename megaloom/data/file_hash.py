"""A cheap, size-bounded hash of a data file: what the checkpoints' data identities (data/identity.py, and
data/chat/identity.py for conversation files) compare on resume."""

from __future__ import annotations

import hashlib
from pathlib import Path

WHOLE_INDEX_BYTES = 4 << 20  # an .idx up to this size is hashed whole
INDEX_BLOCKS, INDEX_BLOCK = 64, 64 << 10  # beyond it: this many blocks of this size, head and tail included


def sampled_hash(path: Path, blocks: int, block: int, whole_below: int = 0) -> str:
    """SHA-256 of the whole file when it is smaller than ``whole_below`` bytes, else of its size and ``blocks``
    blocks of ``block`` bytes at evenly spaced offsets from the first byte to the last block."""
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        if size < whole_below or size <= blocks * block:
            h.update(f.read())
        else:
            last = size - block
            for i in range(blocks):
                f.seek(last * i // (blocks - 1))
                h.update(f.read(block))
    return h.hexdigest()[:16]
