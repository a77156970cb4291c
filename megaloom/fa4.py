"""train.attention=fa4: FlashAttention-4 (the `flash-attn-4` package: CuTe DSL kernels for Hopper and Blackwell)
as the causal attention core of the blocks.

The kernels are FA4's own (`flash_attn.cute.interface`); megaloom only wraps its forward and backward as two
`torch.library` custom ops with shape-only fake versions and an autograd formula, so that autograd and
torch.compile treat the pair as one opaque, traceable op (compiled blocks keep q, k, v, the output and the
log-sum-exp for backward, as they do for SDPA's fused kernels). PyTorch's own route to FA4
(`torch.nn.attention.activate_flash_attention_impl("FA4")`) was tried first: torch 2.11's adapter unpacks two
values from `_flash_attn_fwd`, which flash-attn-4 4.0.0b40 returns five of, so the call fails there.

Layout: the model's attention works in SDPA's [batch, heads, seq, head_dim]; FA4 takes [batch, seq, heads,
head_dim], which is the projections' own layout, so the transposes below are views. Key/value heads may be fewer
than query heads (grouped-query attention): FA4 reads them shared. Only the plain causal case goes here (no
dropout, documents, window or KV cache: `Attention._core` falls back to SDPA for those).
"""

from __future__ import annotations

import functools

import torch

from megaloom import accelerator
from megaloom.errors import ConfigError


def _interface():
    """FA4's Python interface (imported on first use: the package is optional)."""
    from flash_attn.cute import interface

    return interface


@torch.library.custom_op("megaloom::fa4_causal_fwd", mutates_args=())
def _fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse, *_ = _interface()._flash_attn_fwd(q, k, v, softmax_scale=scale, causal=True, return_lse=True)
    return out, lse


@_fwd.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    b, s, h, _ = q.shape
    return q.new_empty((b, s, h, v.shape[-1])), q.new_empty((b, h, s), dtype=torch.float32)


@torch.library.custom_op("megaloom::fa4_causal_bwd", mutates_args=())
def _bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
         lse: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv = _interface()._flash_attn_bwd(q, k, v, out, dout.contiguous(), lse, softmax_scale=scale,
                                              causal=True)[:3]
    return dq, dk, dv


@_bwd.register_fake
def _(dout, q, k, v, out, lse, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.scale = scale


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = _bwd(dout, q, k, v, out, lse, ctx.scale)
    return dq, dk, dv, None


_fwd.register_autograd(_backward, setup_context=_setup_context)


def fa4_takes(head_dim: int) -> bool:
    """Head sizes FA4 runs on both Hopper and Blackwell (8..128, multiples of 8 for 16-byte rows); others keep SDPA."""
    return 8 <= head_dim <= 128 and head_dim % 8 == 0


def fa4_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of SDPA-layout [B, H, T, D] tensors (k, v may have fewer heads) by FA4; same layout out."""
    out, _ = _fwd(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), q.shape[-1] ** -0.5)
    return out.transpose(1, 2)


@functools.cache
def _import_error() -> str | None:
    """Why FA4's interface does not import (None: it does); asked once per process."""
    try:
        _interface()
    except ImportError as e:
        return str(e)
    return None


def fa4_importable() -> bool:
    """Whether FA4's interface imports (train.attention=auto takes it on Hopper/Blackwell where it does)."""
    return _import_error() is None


def fa4_problem(device: torch.device) -> str | None:
    """Why train.attention=fa4 cannot run on ``device`` (None: it can). Cheap: an import and a capability read."""
    capability = accelerator.cuda_capability(device)
    if capability is None:
        return "it needs a CUDA GPU"
    major, minor = capability
    if major not in (9, 10):
        return f"FA4 runs on compute capability 9.0 or 10.x, this GPU is {major}.{minor}"
    if (error := _import_error()) is not None:
        return f"the flash-attn-4 package is not importable ({error}); pip install flash-attn-4"
    return None


def check_fa4(device: torch.device) -> None:
    """Refuse train.attention=fa4 where it cannot run, naming the fix (before any heavy work)."""
    problem = fa4_problem(device)
    if problem is not None:
        raise ConfigError(f"train.attention=fa4: {problem}. Use train.attention=cudnn (or auto).")
