"""data.format=chat: (train rows, valid rows, tokenizer), `build_datasets`' counterpart for conversations.

Conversations are split into train/valid by contiguous ranges (`data.split`, as documents are), packed whole into
rows of ``train.seq_len + 1`` tokens (data/rows.py: a fresh permutation per epoch from the seed, so row i never
depends on how many rows were asked for and a resumed run reads the rows it would have read), and each row padded
with end-of-document tokens that are not targets. A row is the objective layout (data/objective.py): ``[2,
seq_len]`` int64, inputs then labels, the label of every token that is not a target set to the loss's ignore index
(-100, as `cross_entropy`, the fused loss and the vocabulary-parallel loss skip it). The step, pipeline,
evaluation and data-parallel slicing read it as they read BERT's rows; document masks and restarting positions
come from the end-of-document tokens in the inputs (models/documents.py), as for packed text.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from megaloom.data.chat.encode import EncodedChats, load_or_encode
from megaloom.data.chat.templates import resolve_template
from megaloom.data.corpus import cache_root, prepare_default
from megaloom.data.dataset import SizeOnly
from megaloom.data.errors import DataError
from megaloom.data.rows import greedy_rows
from megaloom.data.split import split_ranges
from megaloom.data.tokenizer import Tokenizer
from megaloom.models.fused_ce import IGNORE_INDEX
from megaloom.observe.log import get_logger

if TYPE_CHECKING:
    from megaloom.config import DataConfig

log = get_logger(__name__)


class ChatRows:
    """Row i: the conversations ``rows[i]`` back to back, padded; ``[2, row_len - 1]`` (inputs, labels)."""

    def __init__(self, chats: EncodedChats, rows: list[list[int]], row_len: int, pad_id: int) -> None:
        self.chats, self.rows, self.row_len, self.pad_id = chats, rows, row_len, pad_id

    def __len__(self) -> int:
        return len(self.rows)

    def tokens_and_targets(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Row i's ``row_len`` tokens and target flags (padding: end-of-document tokens, not targets)."""
        tokens = np.full(self.row_len, self.pad_id, dtype=np.int64)
        targets = np.zeros(self.row_len, dtype=bool)
        at, off = 0, self.chats.offsets
        for c in self.rows[i]:
            s, e = int(off[c]), int(off[c + 1])
            tokens[at:at + e - s] = self.chats.tokens[s:e]
            targets[at:at + e - s] = self.chats.targets[s:e]
            at += e - s
        return tokens, targets

    def __getitem__(self, i: int) -> np.ndarray:
        if not 0 <= i < len(self.rows):
            raise IndexError(f"row {i} out of range ({len(self.rows)} rows)")
        tokens, targets = self.tokens_and_targets(i)
        return np.stack([tokens[:-1], np.where(targets[1:], tokens[1:], IGNORE_INDEX)])


def chat_tokenizer(data: DataConfig) -> Tokenizer:
    """data.tokenizer, or the default tokenizer (trained on the embedded corpus) when it is empty."""
    if data.tokenizer:
        return Tokenizer.from_file(data.tokenizer)
    return Tokenizer.from_file(prepare_default(cache_root(data.cache_dir), data.default_vocab_size)[0])


def _plan(chats: EncodedChats, first: int, last: int, row_len: int, seed: int, n_rows: int, role: str,
          ) -> list[list[int]]:
    lengths = chats.lengths()[first:last]
    start, end = int(chats.offsets[first]), int(chats.offsets[last])
    trained = np.add.reduceat(chats.targets[start:end], chats.offsets[first:last] - start, dtype=np.int64)
    # A conversation without a trained token (a template that prints no answer) would make a row with no loss.
    sizes = np.where(trained > 0, lengths, row_len + 1)
    if not (sizes <= row_len).any():
        raise DataError(f"no {role} conversation fits one row of train.seq_len + 1 = {row_len} tokens (shortest: "
                        f"{int(lengths.min())} tokens); raise train.seq_len (and model.max_seq_len)")
    rows, skipped = greedy_rows([sizes], [row_len], seed, n_rows)
    if skipped:
        log.warning(f"data: {skipped} of {last - first} {role} conversation(s) longer than train.seq_len + 1 = "
                    f"{row_len} tokens (or with nothing to train) were left out; raise train.seq_len to keep them")
    return [[first + r for r in row] for row in rows]


def build_chat_datasets(data: DataConfig, seq_len: int, seed: int, n_train: int, n_valid: int,
                        reads_data: bool = True) -> tuple:
    """(train rows, valid rows, tokenizer), called as `build_datasets` is (training/data.py)."""
    tok = chat_tokenizer(data)
    if not reads_data:
        return SizeOnly(n_train), SizeOnly(n_valid), tok
    template = resolve_template(data.chat_template, data.tokenizer, tok.hf.get_vocab())
    chats = load_or_encode(data.paths, template, tok, cache_root(data.cache_dir),
                           eod_inside_ok=not (data.document_mask or data.reset_positions), column=data.chat_column,
                           split=data.chat_split)
    ranges = split_ranges(len(chats), data.split)
    out = []
    for role, n, role_seed in (("train", n_train, seed), ("valid", n_valid, seed + 1)):
        first, last = ranges[role]
        if n and first == last:
            raise DataError(f"data.split={data.split!r} leaves the {role} split of the {len(chats)} conversations "
                            "empty; choose a split that gives every part at least one conversation, e.g. '90,10'")
        rows = _plan(chats, first, last, seq_len + 1, role_seed, n, role) if n else []
        out.append(ChatRows(chats, rows, seq_len + 1, tok.eod_id))
    return out[0], out[1], tok
