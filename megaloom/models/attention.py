"""Causal self-attention with grouped-query heads, RoPE, an optional sliding window and a KV cache.

The core is `scaled_dot_product_attention`, so GPUs use the flash / cuDNN kernels. Head counts are read
from the projection shapes at run time (their width, ``head_dim``, is fixed: model.head_dim or d_model / n_heads),
so tensor parallelism only has to swap the four linear layers. Soft-capped scores (Gemma 2's
model.attn_softcap) are what no fused kernel computes: that core is the math path, `softcapped_attention`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from megaloom.fa4 import fa4_causal_attention, fa4_takes
from megaloom.models.documents import Documents
from megaloom.models.layers import apply_rope

_flex = None


def flex_attention(q, k, v, **kw):
    """FlexAttention, compiled once per process (its eager form materialises the scores: for tests only)."""
    global _flex
    if _flex is None:
        from torch.nn.attention.flex_attention import flex_attention as eager

        _flex = torch.compile(eager, dynamic=False)
    return _flex(q, k, v, **kw)


class KVCache:
    """Preallocated keys and values of one layer for incremental decoding: [B, H_kv, max_len, head_dim]."""

    def __init__(self, batch: int, n_kv_heads: int, max_len: int, head_dim: int, dtype, device):
        self.k = torch.zeros(batch, n_kv_heads, max_len, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)

    def update(self, k: torch.Tensor, v: torch.Tensor, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        t = k.shape[2]
        self.k[:, :, pos:pos + t] = k
        self.v[:, :, pos:pos + t] = v
        return self.k[:, :, :pos + t], self.v[:, :, :pos + t]


def attention_mask(q_len: int, k_len: int, pos: int, window: int, device) -> torch.Tensor:
    """Boolean mask [q_len, k_len], True = may attend: causal, offset by pos, limited to `window` if > 0."""
    q_idx = torch.arange(pos, pos + q_len, device=device)[:, None]
    k_idx = torch.arange(k_len, device=device)[None, :]
    allowed = k_idx <= q_idx
    if window > 0:
        allowed &= (q_idx - k_idx) < window
    return allowed


def softcapped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cap: float, scale: float | None,
                         mask: torch.Tensor | None, dropout_p: float = 0.0) -> torch.Tensor:
    """softmax(cap * tanh(q k^T * scale / cap), masked) v on [B, H, T, D] heads (keys and values of fewer heads are
    shared by groups of query heads). As transformers' eager Gemma 2: the scores in q's dtype, the tanh and softmax
    in fp32, the probabilities back in q's dtype. ``mask``: bool, True = may attend, broadcast to [B, H, Tq, Tk]."""
    if k.shape[1] != q.shape[1]:
        reps = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(reps, dim=1), v.repeat_interleave(reps, dim=1)
    scores = (q @ k.transpose(-2, -1)) * (scale if scale is not None else q.shape[-1] ** -0.5)
    scores = torch.tanh(scores.float() / cap) * cap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = scores.softmax(-1).to(q.dtype)
    if dropout_p:
        probs = F.dropout(probs, dropout_p)
    return probs @ v


LOGIT_CHUNK_ELEMENTS = 1 << 24  # fp32 scores per chunk of `head_logit_max` (64 MiB): bounds its memory


@torch.no_grad()
def head_logit_max(q: torch.Tensor, k: torch.Tensor, scale: float, pos: int = 0, window: int = 0,
                   causal: bool = True, mask: torch.Tensor | None = None,
                   chunk_elements: int = LOGIT_CHUNK_ELEMENTS) -> torch.Tensor:
    """The largest pre-softmax logit (q . k * scale, before any soft-cap) each query head saw, over the positions
    it may attend to: fp32 [H] from q [B, H, Tq, D] and k [B, H_kv, Tk, D] (query head h reads key head
    h // (H / H_kv)). Masks: causal (offset by ``pos``, within ``window`` if > 0), or ``mask`` (bool, True = may
    attend, broadcast to [B, 1, Tq, Tk]: the dense document mask), or none (``causal`` False and no ``mask``).
    The scores are made ``chunk_elements`` at a time along the queries, in fp32 (MuonClip's measurement,
    megaloom/optim/qk_clip.py: SDPA and FlashAttention never return the logits)."""
    b, h, tq, d = q.shape
    hk, tk = k.shape[1], k.shape[2]
    qg = q.reshape(b, hk, h // hk, tq, d)
    kt = k.float().transpose(-2, -1).unsqueeze(2)  # [B, H_kv, 1, D, Tk]
    rows = max(1, chunk_elements // max(1, b * h * tk))
    out = torch.full((h,), float("-inf"), dtype=torch.float32, device=q.device)
    for s in range(0, tq, rows):
        e = min(tq, s + rows)
        scores = (qg[..., s:e, :].float() @ kt) * scale  # [B, H_kv, group, rows, Tk]
        if mask is not None:
            scores.masked_fill_(~mask[:, :, None, s:e, :], float("-inf"))
        elif causal:
            scores.masked_fill_(~attention_mask(e - s, tk, pos + s, window, q.device), float("-inf"))
        out = torch.maximum(out, scores.amax(dim=(0, 3, 4)).reshape(h))
    return out


class Attention(nn.Module):
    # False for encoders (Traits.causal, set by the Block): every token attends to the whole sequence.
    causal = True
    # MuonClip (train.muon_qk_clip, megaloom/optim/qk_clip.py sets it): training forwards record each local query
    # head's largest pre-softmax logit into ``qk_logit_max`` (fp32 [heads], max over the forwards since the
    # optimizer step read and cleared it).
    track_qk_logits = False
    qk_logit_max: torch.Tensor | None = None

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int, bias: bool, dropout: float, window: int,
                 qkv_bias: bool | None = None, norm_eps: float = 1e-5, head_dim: int = 0):
        """``bias``: biases on all four projections; ``qkv_bias``: on q/k/v only (Qwen2/3 style; default
        ``bias``). ``norm_eps`` is for subclasses with norms inside attention (QK-norm). ``head_dim``: the width
        of one head (model.head_dim; 0: d_model / n_heads): q/k/v project d_model to heads x head_dim and o_proj
        projects heads x head_dim back to d_model, so heads may be wider or narrower than d_model / n_heads."""
        super().__init__()
        self.head_dim = head_dim or d_model // n_heads
        qkv_bias = bias if qkv_bias is None else qkv_bias
        self.q_proj = nn.Linear(d_model, n_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(d_model, n_kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(d_model, n_kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(n_heads * self.head_dim, d_model, bias=bias)
        self.core_settings(dropout, window)

    def core_settings(self, dropout: float, window: int, softmax_scale: float | None = None) -> None:
        """What the attention core reads, shared with other attention kinds (latent attention, models/mla.py)."""
        self.attn_dropout = dropout
        self.resid_dropout = nn.Dropout(dropout)
        self.window = window
        # The scale of q k^T (None: SDPA's 1 / sqrt(head size)); latent attention sets DeepSeek's.
        self.softmax_scale = softmax_scale
        # Selective recomputation: recompute the attention core (the largest activations) in backward.
        self.recompute_core = False
        # train.attention=fa4 (set by apply_train_options): the plain causal core by FlashAttention-4 (megaloom.fa4).
        self.fa4 = False
        # Attention-logit soft-capping (model.attn_softcap; set by the family's block): the math core.
        self.softcap = 0.0

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: int,
              docs: Documents | None = None) -> torch.Tensor:
        q_len, k_len = q.shape[2], k.shape[2]
        p = self.attn_dropout if self.training else 0.0
        gqa = q.shape[1] != k.shape[1]
        scale = self.softmax_scale
        if self.softcap:
            return self._softcapped_core(q, k, v, pos, docs, p)
        if docs is not None and docs.mask is not None:  # packed documents kept apart (data.document_mask)
            if isinstance(docs.mask, torch.Tensor):
                return F.scaled_dot_product_attention(q, k, v, attn_mask=docs.mask, dropout_p=p, enable_gqa=gqa,
                                                      scale=scale)
            return flex_attention(q, k, v, block_mask=docs.mask, enable_gqa=gqa, scale=scale)
        if not self.causal:  # an encoder reads whole sequences: no cache, no window, no document masks
            if pos != 0 or q_len != k_len or self.window or docs is not None:
                raise ValueError("bidirectional attention runs on whole sequences only (no KV cache, sliding "
                                 "window or document masks)")
            return F.scaled_dot_product_attention(q, k, v, dropout_p=p, enable_gqa=gqa, scale=scale)
        if self.window == 0 and pos == 0 and q_len == k_len:
            if (self.fa4 and p == 0 and q.dtype in (torch.bfloat16, torch.float16) and fa4_takes(q.shape[-1])
                    and scale is None):  # (FA4's wrapper applies 1 / sqrt(head size))
                return fa4_causal_attention(q, k, v)
            return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True, enable_gqa=gqa, scale=scale)
        if self.window == 0 and q_len == 1:  # one new token attends to everything cached
            return F.scaled_dot_product_attention(q, k, v, dropout_p=p, enable_gqa=gqa, scale=scale)
        mask = attention_mask(q_len, k_len, pos, self.window, q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, enable_gqa=gqa, scale=scale)

    def _softcapped_core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: int,
                         docs: Documents | None, p: float) -> torch.Tensor:
        """The core with soft-capped scores: the math path (FlexAttention's score_mod under a block mask)."""
        cap, scale = self.softcap, self.softmax_scale
        if docs is not None and docs.mask is not None:
            if not isinstance(docs.mask, torch.Tensor):  # a BlockMask (CUDA, no dropout): FlexAttention caps too
                def score_mod(score, b, h, q_idx, k_idx):
                    return torch.tanh(score / cap) * cap

                return flex_attention(q, k, v, block_mask=docs.mask, score_mod=score_mod,
                                      enable_gqa=q.shape[1] != k.shape[1], scale=scale)
            return softcapped_attention(q, k, v, cap, scale, docs.mask, p)
        if not self.causal:
            mask = None
        else:
            mask = attention_mask(q.shape[2], k.shape[2], pos, self.window, q.device)
        return softcapped_attention(q, k, v, cap, scale, mask, p)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: int,
               docs: Documents | None) -> torch.Tensor:
        """The core on [B, H, T, D] heads, recomputed in backward under selective recomputation."""
        if self.recompute_core and torch.is_grad_enabled():
            return checkpoint(self._core, q, k, v, pos, docs, use_reentrant=False)
        return self._core(q, k, v, pos, docs)

    def per_head_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries and keys [B, T, H, D] after the projections, before RoPE: unchanged here; a family's
        attention overrides it (QK-norm)."""
        return q, k

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                cache: KVCache | None = None, pos: int = 0, docs: Documents | None = None) -> torch.Tensor:
        b, t, _ = x.shape
        q, k = self.per_head_qk(self.q_proj(x).view(b, t, -1, self.head_dim),
                                self.k_proj(x).view(b, t, -1, self.head_dim))
        v = self.v_proj(x).view(b, t, -1, self.head_dim)
        if rope is not None:
            cos, sin = rope
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H, T, D]
        if cache is not None:
            k, v = cache.update(k, v, pos)
        if self.track_qk_logits and self.training:
            self.record_qk_logits(q, k, pos, docs)
        y = self.attend(q, k, v, pos, docs).transpose(1, 2).reshape(b, t, -1)
        return self.resid_dropout(self.o_proj(y))

    @torch.no_grad()
    def record_qk_logits(self, q: torch.Tensor, k: torch.Tensor, pos: int, docs: Documents | None) -> None:
        """MuonClip's measurement (``track_qk_logits``): the max of this forward's logits per head into
        ``qk_logit_max``. A dense document mask is respected; FlexAttention's block mask (no dense form) is not:
        the causal mask stands in, a superset, so a head is at worst clipped for a logit across documents."""
        scale = self.softmax_scale if self.softmax_scale is not None else q.shape[-1] ** -0.5
        mask = docs.mask if docs is not None and isinstance(docs.mask, torch.Tensor) else None
        m = head_logit_max(q, k, scale, pos, self.window, self.causal, mask)
        self.qk_logit_max = m if self.qk_logit_max is None else torch.maximum(self.qk_logit_max, m)
