"""Small building blocks of the transformer: norms, rotary embeddings, the MLP variants."""

from __future__ import annotations

import math
from dataclasses import dataclass

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


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling for contexts longer than pretraining (model.rope_scaling and the rope_* keys).

    ``kind`` "llama3" (Llama 3.1/3.2/3.3): wavelengths longer than original_max_len / low_freq_factor are divided
    by ``factor``, those shorter than original_max_len / high_freq_factor are kept, and the ones between are
    interpolated smoothly. ``kind`` "yarn" (YaRN, as Qwen2.5/Qwen3 and transformers' "yarn" compute it): a linear
    ramp between interpolated (/ factor) and original frequencies over the dimensions whose number of rotations
    within original_max_len lies between ``beta_slow`` and ``beta_fast`` (the ramp's ends rounded outward when
    ``truncate``), and cos/sin multiplied by ``attention_factor`` (0: 0.1 ln(factor) + 1)."""

    kind: str
    factor: float
    original_max_len: int
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 0.0
    truncate: bool = True


def rope_scaling_of(cfg) -> RopeScaling | None:
    """The RoPE scaling a ModelConfig asks for (None: plain RoPE)."""
    kind = getattr(cfg, "rope_scaling", "none")
    if kind in ("none", "", None):
        return None
    return RopeScaling(kind, cfg.rope_factor, cfg.rope_original_max_len, cfg.rope_low_freq_factor,
                       cfg.rope_high_freq_factor, cfg.rope_beta_fast, cfg.rope_beta_slow, cfg.rope_attention_factor,
                       cfg.rope_truncate)


def yarn_default_attention_factor(factor: float) -> float:
    """YaRN's cos/sin scale when none is given: 0.1 ln(factor) + 1 (1 for factor <= 1)."""
    return 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0


def _llama3_inv_freq(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    low_wavelen = s.original_max_len / s.low_freq_factor
    high_wavelen = s.original_max_len / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_inv_freq(pos_freqs: torch.Tensor, head_dim: int, theta: float, s: RopeScaling) -> torch.Tensor:
    def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times in original_max_len
        return head_dim * math.log(s.original_max_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # 1: the original frequency, 0: interpolated
    return 1.0 / (s.factor * pos_freqs) * (1 - extrapolation) + 1.0 / pos_freqs * extrapolation


def rope_tables(head_dim: int, max_len: int, theta: float,
                scaling: RopeScaling | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [max_len, head_dim] for the rotate-half convention (the Hugging Face Llama layout), with the
    frequencies (and, for YaRN, the magnitude) of ``scaling`` if given.

    In float32, operation for operation as transformers computes them (and as the released models were trained):
    the frequencies ``1 / theta^(2i/d)``, each angle ``position x frequency`` rounded to float32, its cos/sin. An
    exact (float64) angle differs from that rounding by up to ~position x 2^-24 radians, which grows with the
    position: tables computed in float64 put the logits of an imported Gemma 2 (scores of several units) 5e-6 from
    transformers' before position 64 and 5e-5 by position 500, and equal to them (0 difference) in float32
    (issue 49; tests/checkpoint/test_hf_gemma.py)."""
    pos_freqs = theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    inv_freq = 1.0 / pos_freqs
    magnitude = 1.0
    if scaling is not None:
        if scaling.kind == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        elif scaling.kind == "yarn":
            inv_freq = _yarn_inv_freq(pos_freqs, head_dim, theta, scaling)
            magnitude = scaling.attention_factor or yarn_default_attention_factor(scaling.factor)
        else:
            raise ValueError(f"unknown RoPE scaling {scaling.kind!r}; one of llama3, yarn")
    angles = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq.float())
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos() * magnitude, angles.sin() * magnitude


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
