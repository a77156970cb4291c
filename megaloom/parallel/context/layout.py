"""Where each token of a sequence lives under context parallelism: the load-balanced causal split.

The sequence of T tokens is cut into 2 * cp chunks of c = T / (2 * cp) tokens; cp rank r holds chunks r and
2 * cp - 1 - r, in that order (Megatron-Core's and TorchTitan's "zigzag"/head-tail split). With a causal mask
the early chunks attend to few keys and the late ones to many; pairing chunk r with its mirror gives every rank
the same number of (query, key) pairs, so no rank waits for another in the ring.

Both attention modes (ring and all-to-all) and everything else along the sequence (the data split, RoPE and
learned positions) use this one split, so a model's tokens are laid out the same way whatever the mode.
"""

from __future__ import annotations

import torch


def chunks_of(cp: int, rank: int) -> tuple[int, int]:
    """The two chunk indices cp rank ``rank`` holds, in its local order."""
    return rank, 2 * cp - 1 - rank


def local_positions(local_len: int, cp: int, rank: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Global positions [local_len] of this rank's tokens (its two chunks, in order)."""
    c = local_len // 2
    first, second = chunks_of(cp, rank)
    return torch.cat([torch.arange(first * c, (first + 1) * c, device=device),
                      torch.arange(second * c, (second + 1) * c, device=device)])


def shard_sequence(x: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's two chunks of a full-length tensor along ``dim`` (tokens or labels [B, T] -> [B, T / cp])."""
    if cp == 1:
        return x
    n = x.shape[dim]
    if n % (2 * cp):
        raise ValueError(f"context parallelism: a sequence of {n} tokens cannot be cut into 2 * cp = {2 * cp} "
                         "equal chunks; train.seq_len must be a multiple of 2 * parallel.cp")
    c = n // (2 * cp)
    first, second = chunks_of(cp, rank)
    return torch.cat([x.narrow(dim, first * c, c), x.narrow(dim, second * c, c)], dim=dim)


def natural_order(cp: int, chunk: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Index that puts a sequence gathered in rank order (rank 0's two chunks, rank 1's, ...) back into natural
    token order: ``gathered.index_select(dim, natural_order(...))`` is the sequence 0 .. T-1."""
    owner = torch.empty(2 * cp, dtype=torch.long)  # slot in the rank-ordered layout of each natural chunk
    for r in range(cp):
        a, b = chunks_of(cp, r)
        owner[a], owner[b] = 2 * r, 2 * r + 1
    offsets = torch.arange(chunk)
    return (owner[:, None] * chunk + offsets[None, :]).reshape(-1).to(device)


class SequenceShard:
    """Callable: a full-length [B, T] tensor -> this cp rank's [B, T / cp] (what the step, the evaluation and
    the pipeline apply to tokens and labels)."""

    def __init__(self, cp: int, rank: int) -> None:
        self.cp, self.rank = cp, rank

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return shard_sequence(x, self.cp, self.rank)


class SequencePositions:
    """Callable: (local length, device) -> global positions of this rank's tokens. Set on the model as
    ``seq_positions``; RoPE tables and learned position embeddings are indexed by it."""

    def __init__(self, cp: int, rank: int) -> None:
        self.cp, self.rank = cp, rank
        self._cache: dict[tuple[int, str], torch.Tensor] = {}

    def __call__(self, local_len: int, device: torch.device | str) -> torch.Tensor:
        key = (local_len, str(device))
        if key not in self._cache:
            self._cache[key] = local_positions(local_len, self.cp, self.rank, device)
        return self._cache[key]
