"""Qwen3's attention: megaloom's grouped-query attention with QK-norm, an RMSNorm over each query and key head
(weights of size head_dim, shared by all heads) applied after the projections and BEFORE RoPE, as Hugging
Face's Qwen3Attention does.

The projections keep the decoder's names (q_proj, k_proj, v_proj, o_proj), so the decoder plan's column /
row-parallel entries apply unchanged; under tensor parallelism each rank normalises its own heads, which is
why the qwen3 plan marks q_norm / k_norm as `PartialGrad`. The KV cache stores keys after norm and RoPE, and
selective recomputation / dropout streams are the base class's: only `per_head_qk` differs.
"""

from __future__ import annotations

import torch
from torch import nn

from megaloom.models.attention import Attention


class Qwen3Attention(Attention):
    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int, bias: bool, dropout: float, window: int,
                 qkv_bias: bool | None = None, norm_eps: float = 1e-6, head_dim: int = 0):
        super().__init__(d_model, n_heads, n_kv_heads, bias, dropout, window, qkv_bias=qkv_bias, norm_eps=norm_eps,
                         head_dim=head_dim)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=norm_eps)
        self.k_norm = nn.RMSNorm(self.head_dim, eps=norm_eps)

    def per_head_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q_norm(q), self.k_norm(k)
