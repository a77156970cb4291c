"""Fixed-length training samples cut from a contiguous range of documents."""

from __future__ import annotations

import numpy as np

from megaloom.data.errors import DataError
from megaloom.data.indexed import IndexedTokens


class PackedDataset:
    """Documents ``doc_range`` of ``tokens`` read as one stream (EOD tokens already separate them).

    Sample ``i`` is the ``seq_len + 1`` tokens starting at ``i * seq_len``: inputs are ``[:-1]``, labels
    ``[1:]``, and consecutive samples share one token so that no label is ever lost at a boundary.
    Packing across documents wastes no tokens on padding; the EOD tokens tell the model where one ends.
    """

    def __init__(self, tokens: IndexedTokens, seq_len: int, doc_range: tuple[int, int],
                 split: str = "data") -> None:
        first, last = doc_range
        if not 0 <= first <= last <= tokens.n_docs:
            raise DataError(f"{split} document range {doc_range} is outside the {tokens.n_docs} documents of "
                            f"{tokens.prefix}")
        if seq_len < 1:
            raise DataError(f"train.seq_len must be at least 1, got {seq_len}")
        self.tokens, self.seq_len, self.doc_range, self.split = tokens, seq_len, (first, last), split
        self.start = int(tokens.doc_offsets[first])
        self.end = int(tokens.doc_offsets[last])
        self.n_samples = (self.end - self.start - 1) // seq_len
        if self.n_samples < 1:
            raise DataError(f"the {split} split of {tokens.prefix} (documents {first}..{last - 1}) has "
                            f"{self.end - self.start} tokens, fewer than one sample of train.seq_len + 1 = "
                            f"{seq_len + 1}; use a smaller train.seq_len, more data, or a different "
                            "data.split")

    def __len__(self) -> int:
        return self.n_samples

    def __getitem__(self, i: int) -> np.ndarray:
        if not 0 <= i < self.n_samples:
            raise IndexError(f"sample {i} out of range for the {self.split} split ({self.n_samples} samples)")
        s = self.start + i * self.seq_len
        return np.array(self.tokens.tokens[s:s + self.seq_len + 1], dtype=np.int64)
