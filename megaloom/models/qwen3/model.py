"""Qwen3's attention: megaloom's grouped-query attention with QK-norm, an RMSNorm over each query and key head
(weights of size head_dim, shared by all heads) applied after the projections and BEFORE RoPE, as Hugging
Face's Qwen3Attention does.

The projections keep the decoder's names (q_proj, k_proj, v_proj, o_proj), so the decoder plan's column /
row-parallel entries apply unchanged; under tensor parallelism each rank normalises its own heads, which is
why the qwen3 plan marks q_norm / k_norm as `PartialGrad`. The KV cache stores keys after norm and RoPE, and
selective recomputation / dropout streams act on the same `_core` as in the base class.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from megaloom.models.attention import Attention, KVCache
from megaloom.models.layers import apply_rope


class Qwen3Attention(Attention):
    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int, bias: bool, dropout: float, window: int,
                 qkv_bias: bool | None = None, norm_eps: float = 1e-6):
        super().__init__(d_model, n_heads, n_kv_heads, bias, dropout, window, qkv_bias=qkv_bias, norm_eps=norm_eps)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=norm_eps)
        self.k_norm = nn.RMSNorm(self.head_dim, eps=norm_eps)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                cache: KVCache | None = None, pos: int = 0) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, t, -1, self.head_dim))
        k = self.k_norm(self.k_proj(x).view(b, t, -1, self.head_dim))
        v = self.v_proj(x).view(b, t, -1, self.head_dim)
        if rope is not None:
            cos, sin = rope
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H, T, D]
        if cache is not None:
            k, v = cache.update(k, v, pos)
        if self.recompute_core and torch.is_grad_enabled():
            y = checkpoint(self._core, q, k, v, pos, use_reentrant=False)
        else:
            y = self._core(q, k, v, pos)
        y = y.transpose(1, 2).reshape(b, t, -1)
        return self.resid_dropout(self.o_proj(y))
