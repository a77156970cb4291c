"""All-to-all (DeepSpeed-Ulysses) attention: trade the sequence split for a head split around the attention core.

Before the core, each cp rank holds all heads of its T/cp tokens; one all-to-all gives it H/cp heads of all T
tokens, it runs ordinary full-sequence SDPA (flash / cuDNN on GPU, any mask such as a sliding window), and a
second all-to-all gives the heads back. Two all-to-alls of q, k, v and out per layer instead of cp-1 ring steps:
cheaper on fast links, but it needs the (tensor-parallel-local) query and key/value head counts to be multiples
of cp. The gathered sequence arrives in rank order of the load-balanced split (layout.py) and is put into
natural order for the core, then back. Under torch.compile the exchanges are functional all-to-alls
(`borders.all_to_all_equal`'s traced form), so a compiled block stays one graph (the in-place c10d op and the recorder's
bookkeeping would split it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megaloom.models.attention import attention_mask
from megaloom.parallel import borders, comm


def _rank_to_natural(x: torch.Tensor, cp: int) -> torch.Tensor:
    """[B, H, cp, T/cp, D] (every rank's two chunks, in rank order) -> [B, H, T, D] in natural token order: rank r
    holds chunks r and 2cp-1-r (layout.py), so the ranks' first chunks are chunks 0 .. cp-1 in order and their
    second chunks, in reverse rank order, chunks cp .. 2cp-1. A copy by slices, which saves no index tensor for
    backward (``layout.natural_order`` gives the same permutation as an index)."""
    b, h, _, t, d = x.shape
    halves = x.view(b, h, cp, 2, t // 2, d)
    return torch.cat([halves[:, :, :, 0], halves[:, :, :, 1].flip(2)], dim=2).view(b, h, cp * t, d)


def _natural_to_rank(y: torch.Tensor, cp: int) -> torch.Tensor:
    """The inverse of `_rank_to_natural`: [B, H, T, D] -> [B, H, cp, T/cp, D]."""
    b, h, n, d = y.shape
    halves = y.view(b, h, 2, cp, n // (2 * cp), d)
    return torch.stack([halves[:, :, 0], halves[:, :, 1].flip(2)], dim=3).view(b, h, cp, n // cp, d)


def _seq_to_heads(x: torch.Tensor, group, recorder) -> torch.Tensor:
    """[B, H, T/cp, D] (all heads, local tokens) -> [B, H/cp, T, D] (local heads, every token, natural order)."""
    cp = comm.group_size(group)
    b, h, t, d = x.shape
    rows = x.permute(1, 0, 2, 3).contiguous()  # head j's rows go to rank j // (h / cp)
    got = borders.all_to_all_equal(rows, group, h // cp, recorder)
    return _rank_to_natural(got.view(cp, h // cp, b, t, d).permute(2, 1, 0, 3, 4), cp)


def _heads_to_seq(y: torch.Tensor, group, recorder) -> torch.Tensor:
    """The inverse of `_seq_to_heads`: [B, H/cp, T, D] -> [B, H, T/cp, D]."""
    cp = comm.group_size(group)
    b, hl, n, d = y.shape
    by_rank = _natural_to_rank(y, cp).permute(2, 1, 0, 3, 4).reshape(cp * hl, b, n // cp, d)
    got = borders.all_to_all_equal(by_rank, group, hl, recorder)  # from rank j: its heads, our tokens
    return got.permute(1, 0, 2, 3)


def alltoall_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, recorder=None, window: int = 0,
                       dropout_p: float = 0.0, mask=None, scale: float | None = None) -> torch.Tensor:
    """Causal attention (optionally within a sliding ``window``) of this cp rank's tokens over the whole
    sequence; q [B, H, T/cp, D], k, v [B, Hkv, T/cp, D], with cp dividing H and Hkv. Returns [B, H, T/cp, D].
    ``mask``: the whole sequence's attention mask in natural order, which replaces the causal rule (packed
    documents, models/documents.py: a dense bool [B, 1, T, T] for SDPA or a FlexAttention block mask). ``scale``:
    the softmax scale (None: 1 / sqrt(D))."""
    cp = comm.group_size(group)
    h, hkv = q.shape[1], k.shape[1]
    if h % cp or hkv % cp:
        raise ValueError(f"all-to-all attention needs the query heads ({h}) and key/value heads ({hkv}) on this "
                         f"rank to be multiples of parallel.cp={cp}; use parallel.cp_mode=ring")
    qf, kf, vf = (_seq_to_heads(x, group, recorder) for x in (q, k, v))
    gqa = qf.shape[1] != kf.shape[1]
    if mask is not None and not isinstance(mask, torch.Tensor):  # a block mask: FlexAttention (GPUs, compiled)
        from torch.nn.attention.flex_attention import flex_attention

        y = flex_attention(qf, kf, vf, block_mask=mask, enable_gqa=gqa, scale=scale)
    elif mask is not None:
        y = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=mask, dropout_p=dropout_p, enable_gqa=gqa,
                                           scale=scale)
    elif window:
        n = qf.shape[2]
        y = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=attention_mask(n, n, 0, window, q.device),
                                           dropout_p=dropout_p, enable_gqa=gqa, scale=scale)
    else:
        y = F.scaled_dot_product_attention(qf, kf, vf, is_causal=True, dropout_p=dropout_p, enable_gqa=gqa,
                                           scale=scale)
    return _heads_to_seq(y, group, recorder)
