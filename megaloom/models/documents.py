"""Document boundaries inside packed samples: who may attend to whom, and the positions that restart.

Samples are packed across documents (megaloom/data/packed.py), the end-of-document (EOD) token closing each one.
With `data.document_mask=true` a token attends only to earlier tokens of its own document, as if every document
were its own sample; with `data.reset_positions=true` its position (RoPE angle, learned position row) counts from
the start of its document. Both are derived from the input tokens alone, so no data format changes and every
rank that holds the tokens derives the same boundaries. The EOD token belongs to the document it ends.

Under context parallelism the boundaries come from the whole sequence before it is split (step.model_inputs): each
rank keeps the positions of its own tokens, and the all-to-all attention core, which sees every token in natural
order, applies the whole mask (parallel/context/alltoall.py); ring attention does not take masks yet.

The attention kernels take the boundaries in two forms: a dense boolean mask [B, 1, T, T] for SDPA (exact,
any device; O(T^2) memory, fine up to a few thousand tokens) and, on GPUs, FlexAttention's block mask, which
skips the blocks that cross documents without materialising the mask.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch


@dataclass(frozen=True)
class Documents:
    """Per-token document ids [B, T] (0, 1, ... in each row), the positions [B, T] when they restart per
    document, and the attention mask once `with_mask` made it (before the blocks run, so that compiled blocks
    only read it): a dense bool [B, 1, T, T] for SDPA, or a FlexAttention BlockMask."""

    ids: torch.Tensor
    positions: torch.Tensor | None = None
    masked: bool = True  # False: positions restart per document, attention still crosses documents
    mask: Any = None

    @classmethod
    def from_tokens(cls, tokens: torch.Tensor, eod_id: int, mask: bool = True,
                    reset_positions: bool = False) -> Documents:
        ends = tokens == eod_id
        # a token's document = the EODs strictly before it (the EOD itself still belongs to its document)
        ids = torch.cumsum(ends, dim=1) - ends.long()
        positions = None
        if reset_positions:
            t = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
            # each document's first index, spread over its tokens: the running max of the indices where one starts
            starts = torch.zeros_like(ends)
            starts[:, 0] = True
            starts[:, 1:] = ends[:, :-1]
            first = torch.cummax(torch.where(starts, t, torch.zeros_like(t)), dim=1).values
            positions = t - first
        return cls(ids, positions, masked=mask)

    def sharded(self, shard) -> Documents:
        """This context-parallel rank's view (``shard``: [B, T] -> [B, T / cp], parallel.context.SequenceShard):
        the positions of its own tokens; the document ids stay whole, since the all-to-all attention core sees
        the whole sequence and builds its mask from them."""
        return replace(self, positions=None if self.positions is None else shard(self.positions))

    def with_mask(self, window: int = 0, flex: bool = False) -> Documents:
        """A copy holding the attention mask (built once per forward, shared by every layer)."""
        if self.mask is not None or not self.masked:
            return self
        return replace(self, mask=self.block_mask(window) if flex else self.dense_mask(window))

    def dense_mask(self, window: int = 0) -> torch.Tensor:
        """[B, 1, T, T] bool, True = may attend: causal, same document, within `window` tokens if > 0."""
        t = self.ids.shape[1]
        idx = torch.arange(t, device=self.ids.device)
        allowed = (idx[None, :] <= idx[:, None])[None]  # [1, T, T] causal
        if window > 0:
            allowed = allowed & ((idx[:, None] - idx[None, :]) < window)[None]
        same = self.ids[:, :, None] == self.ids[:, None, :]  # [B, T, T]
        return (allowed & same)[:, None]

    def block_mask(self, window: int = 0):
        """FlexAttention's BlockMask for the same rule: blocks wholly inside other documents are skipped."""
        from torch.nn.attention.flex_attention import create_block_mask

        ids = self.ids

        def rule(b, h, q, k):
            ok = (k <= q) & (ids[b, q] == ids[b, k])
            if window > 0:
                ok = ok & (q - k < window)
            return ok

        b, t = ids.shape
        return create_block_mask(rule, b, None, t, t, device=ids.device)
