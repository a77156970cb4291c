"""Multi-head latent attention (DeepSeek-V2 / V3), ``model.attention=mla``.

Keys and values of a token come from one low-rank latent instead of per-head projections of the hidden state:

    kv_a_proj(x) = [c_kv | k_rope]    c_kv: kv_lora_rank wide, normed by kv_a_norm; k_rope: qk_rope_head_dim wide
    kv_b_proj(c_kv) = per head [k_nope | v]             (qk_nope_head_dim, v_head_dim)
    key of head h = [k_nope_h | RoPE(k_rope)]           one rotated key part shared by every head ("decoupled RoPE")
    query         = q_proj(x), or q_b_proj(q_a_norm(q_a_proj(x))) with q_lora_rank > 0, per head [q_nope | q_rope]

so a decoding cache holds c_kv and the rotated k_rope (kv_lora_rank + qk_rope_head_dim numbers per token and
layer; `LatentCache`) instead of 2 x heads x head size. The softmax scale is DeepSeek's: 1 / sqrt(q/k head size),
times mscale^2 = (0.1 * model.rope_mscale_all_dim * ln(model.rope_factor) + 1)^2 under YaRN scaling, as the
reference code and transformers' ``yarn_apply_mscale`` compute it.

The core is the shared one (`Attention._core`: SDPA, document masks, sliding window, context parallelism's
ring / all-to-all, dropout streams), run on the expanded heads. Fused kernels (flash on CPU and GPU, cuDNN,
FA4) take one head size for q, k and v, so the narrower of the two (v: 128 beside 192 in DeepSeek-V3) is padded
with zeros and the padding sliced off the output: zero value columns give zero output columns, and the slice
gives the padding no gradient. The names follow Hugging Face's DeepseekV3Attention (``kv_a_proj`` is its
``kv_a_proj_with_mqa``, the norms ``*_a_norm`` its ``*_a_layernorm``), so conversion is renaming plus the RoPE
layout (models/llama/hf_deepseek.py).

Tensor parallelism (models/plan.py): q_proj / q_b_proj and kv_b_proj column-parallel by heads, o_proj
row-parallel, the down-projections q_a_proj / kv_a_proj replicated on every tp rank (a column-parallel linear all
of whose rows each rank holds, so sequence parallelism's region saves only the local shard for them as well) and
the latent norms replicated; each rank's gradient of those is a partial sum over its heads, summed over tp as a
replicated KV head's is. Head counts are read from the projection shapes, as the grouped-query attention does.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from megaloom.config import ModelConfig
from megaloom.models.attention import Attention
from megaloom.models.attention_shapes import qk_head_dim
from megaloom.models.documents import Documents
from megaloom.models.layers import apply_rope


def mla_softmax_scale(m: ModelConfig) -> float:
    """DeepSeek's scale of q k^T: 1 / sqrt(q/k head size), with YaRN's mscale squared when the RoPE is scaled."""
    scale = qk_head_dim(m) ** -0.5
    if m.rope_scaling == "yarn" and m.rope_mscale_all_dim and m.rope_factor > 1:
        mscale = 0.1 * m.rope_mscale_all_dim * math.log(m.rope_factor) + 1.0
        scale *= mscale * mscale
    return scale


class LatentCache:
    """Preallocated decoding cache of one latent-attention layer: the normed latent [B, max_len, kv_lora_rank] and
    the rotated shared key [B, max_len, 1, qk_rope_head_dim]; keys and values are expanded from it each step."""

    def __init__(self, batch: int, max_len: int, kv_lora_rank: int, rope_dim: int, dtype, device):
        self.latent = torch.zeros(batch, max_len, kv_lora_rank, dtype=dtype, device=device)
        self.k_rope = torch.zeros(batch, max_len, 1, rope_dim, dtype=dtype, device=device)

    def update(self, latent: torch.Tensor, k_rope: torch.Tensor, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        t = latent.shape[1]
        self.latent[:, pos:pos + t] = latent
        self.k_rope[:, pos:pos + t] = k_rope
        return self.latent[:, :pos + t], self.k_rope[:, :pos + t]


class MLAttention(Attention):
    def __init__(self, cfg: ModelConfig):
        nn.Module.__init__(self)
        d, h = cfg.d_model, cfg.n_heads
        self.q_lora_rank, self.kv_lora_rank = cfg.q_lora_rank, cfg.kv_lora_rank
        self.nope_dim, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.qk_dim = self.nope_dim + self.rope_dim
        if self.q_lora_rank:
            self.q_a_proj = nn.Linear(d, self.q_lora_rank, bias=False)
            self.q_a_norm = nn.RMSNorm(self.q_lora_rank, eps=cfg.norm_eps)
            self.q_b_proj = nn.Linear(self.q_lora_rank, h * self.qk_dim, bias=False)
        else:
            self.q_proj = nn.Linear(d, h * self.qk_dim, bias=False)
        self.kv_a_proj = nn.Linear(d, self.kv_lora_rank + self.rope_dim, bias=False)
        self.kv_a_norm = nn.RMSNorm(self.kv_lora_rank, eps=cfg.norm_eps)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, h * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = nn.Linear(h * self.v_dim, d, bias=False)
        self.core_settings(cfg.dropout, cfg.sliding_window, mla_softmax_scale(cfg))

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, H, qk head] (this rank's heads)."""
        q = self.q_b_proj(self.q_a_norm(self.q_a_proj(x))) if self.q_lora_rank else self.q_proj(x)
        return q.view(*x.shape[:2], -1, self.qk_dim)

    def new_cache(self, batch: int, max_len: int, dtype=None) -> LatentCache:
        w = self.kv_a_proj.weight
        return LatentCache(batch, max_len, self.kv_lora_rank, self.rope_dim, dtype or w.dtype, w.device)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                cache: LatentCache | None = None, pos: int = 0, docs: Documents | None = None) -> torch.Tensor:
        b, t, _ = x.shape
        q_nope, q_rope = self.queries(x).split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_rope = self.kv_a_proj(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        latent, k_rope = self.kv_a_norm(latent), k_rope.view(b, t, 1, self.rope_dim)
        if rope is not None:
            cos, sin = rope
            q_rope, k_rope = apply_rope(q_rope, cos, sin), apply_rope(k_rope, cos, sin)
        if cache is not None:
            latent, k_rope = cache.update(latent, k_rope, pos)
        kv = self.kv_b_proj(latent)
        k_nope, v = kv.view(*kv.shape[:2], -1, self.nope_dim + self.v_dim).split([self.nope_dim, self.v_dim], -1)
        heads = k_nope.shape[2]
        q = torch.cat([q_nope, q_rope.to(q_nope.dtype)], dim=-1)
        k = torch.cat([k_nope, k_rope.to(k_nope.dtype).expand(-1, -1, heads, -1)], dim=-1)
        y = self._attend_padded(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), pos, docs)
        return self.resid_dropout(self.o_proj(y.transpose(1, 2).reshape(b, t, -1)))

    def _attend_padded(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: int,
                       docs: Documents | None) -> torch.Tensor:
        """The core with q, k and v at one head size (module doc); returns [B, H, T, v head]."""
        width = max(self.qk_dim, self.v_dim)
        if self.qk_dim < width:
            q, k = F.pad(q, (0, width - self.qk_dim)), F.pad(k, (0, width - self.qk_dim))
        if self.v_dim < width:
            v = F.pad(v, (0, width - self.v_dim))
        y = self.attend(q, k, v, pos, docs)
        return y[..., :self.v_dim] if self.v_dim < width else y
