"""Small building blocks of the transformer: norms, rotary embeddings, the MLP variants."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

NORMS = ("layernorm", "rmsnorm")


def make_norm(kind: str, dim: int, eps: float) -> nn.Module:
    """``layernorm`` (with bias, GPT-2) or ``rmsnorm`` (Llama): both PyTorch's own fused kernels."""
    if kind not in NORMS:
        raise ValueError(f"unknown norm {kind!r}; one of {NORMS}")
    return nn.LayerNorm(dim, eps=eps) if kind == "layernorm" else nn.RMSNorm(dim, eps=eps)


def norm_input(x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """``x`` in ``norm``'s weight dtype: a bf16 residual stream (train.bf16_residual) is normalised in fp32, as an
    fp32 one is; a no-op when the dtypes agree (fp32 training, a bf16 model)."""
    w = getattr(norm, "weight", None)
    return x.to(w.dtype) if w is not None and x.dtype != w.dtype and x.is_floating_point() else x


def rope_tables(head_dim: int, max_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [max_len, head_dim] for the rotate-half convention (the Hugging Face Llama layout)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(max_len, dtype=torch.float64), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, T, H, D] by position; cos/sin are [T, D] (or [B, T, D]: positions per sample, e.g. restarting
    at each document). Computed in fp32, returned in x's dtype."""
    d = x.shape[-1] // 2
    xf = x.float()
    rotated = torch.cat([-xf[..., d:], xf[..., :d]], dim=-1)
    c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)  # broadcast over the heads
    return (xf * c + rotated * s).to(x.dtype)


class HeadTransform(nn.Module):
    """BERT's masked-LM head transform, in the final-norm slot: ``norm(gelu(dense(x)))`` (exact erf GeLU)."""

    def __init__(self, kind: str, dim: int, eps: float):
        super().__init__()
        self.dense = nn.Linear(dim, dim)
        self.norm = make_norm(kind, dim, eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(F.gelu(self.dense(x)))


def first_token(x: torch.Tensor) -> torch.Tensor:
    """The hidden state at position 0 of [B, T, D]: [B, D]."""
    return x[:, 0]


class Pooler(nn.Module):
    """BERT's pooler: ``tanh(dense(h))`` of the final hidden state ``h`` at position 0 ([CLS]), what a
    sentence-level head reads. ``first`` picks that position; under sequence parallelism the plan replaces it
    (only tp rank 0's shard holds position 0)."""

    def __init__(self, dim: int):
        super().__init__()
        self.dense = nn.Linear(dim, dim)
        self.first = first_token

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(self.first(x)))


class MLP(nn.Module):
    """SwiGLU if ``gated`` (down(silu(gate x) * up x), Llama) or GeLU (down(gelu(up x)), GPT-2). ``gelu``: the
    GeLU's approximation, "tanh" (GPT-2) or "none" (exact erf, BERT)."""

    def __init__(self, gated: bool, d_model: int, ffn_dim: int, bias: bool, dropout: float, gelu: str = "tanh"):
        super().__init__()
        self.gated, self.gelu = gated, gelu
        if self.gated:
            self.gate_proj = nn.Linear(d_model, ffn_dim, bias=bias)
        self.up_proj = nn.Linear(d_model, ffn_dim, bias=bias)
        self.down_proj = nn.Linear(ffn_dim, d_model, bias=bias)
        self.dropout = nn.Dropout(dropout)
        # Selective recomputation: keep the GEMM inputs, recompute the cheap elementwise activation in backward.
        self.recompute_activation = False

    def _act(self, up: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        if gate is not None:
            return F.silu(gate) * up
        return F.gelu(up, approximate=self.gelu)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        up = self.up_proj(x)
        gate = self.gate_proj(x) if self.gated else None
        if self.recompute_activation and torch.is_grad_enabled():
            h = checkpoint(self._act, up, gate, use_reentrant=False)
        else:
            h = self._act(up, gate)
        return self.dropout(self.down_proj(h))
