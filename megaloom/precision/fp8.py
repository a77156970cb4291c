"""FP8 training of the transformer's linear layers (``train.precision=fp8``), written on ``torch._scaled_mm``.

One linear ``y = x W^T (+ b)`` becomes three fp8 GEMMs with *current* scaling: each operand's scale is
computed from the tensor at hand (``scale = fp8_max / max(amax, eps)``), it is cast to fp8 saturating, and
the GEMM multiplies by the inverse scales in its epilogue, accumulating in fp32.

  recipe      forward y = x W^T        grad_input dx = dy W       grad_weight dW = dy^T x
  tensorwise  e4m3 x e4m3, per tensor  e5m2 x e4m3, per tensor    e5m2 x e4m3, per tensor
  rowwise     e4m3 x e4m3, per row     e4m3 x e4m3, per row       high precision (bf16) GEMM
  blockwise   e4m3, 1x128 x 128x128    e4m3, 1x128 x 128x128      e4m3, 1x128 x 1x128 along tokens

``blockwise`` (DeepSeek-V3's recipe) lives in `megaloom.precision.fp8_block`: one scale per 1x128 tile of the
activations and gradients and per 128x128 block of the weight, fp32 accumulation; `float8_linear` hands it over.

The forward GEMM uses Hopper's fast fp8 accumulation by default (as torchao does): partial sums stay in the
tensor cores' reduced-precision accumulator (about 14 bits, per DeepSeek-V3's report) instead of being promoted
to fp32 every few K-blocks. ``fast_accum=False`` (``train.fp8_fast_accum=false``) promotes them: slower GEMMs,
more exact sums. The backward GEMMs always promote.

``rowwise`` scales each row of the left operand and each column of the right operand along the
contracted dimension (torchao's "rowwise_with_gw_hp": the weight gradient, which sums over all tokens,
stays in bf16). Only the matmul runs in fp8: master weights stay fp32 (and their gradient comes back
fp32, so data parallelism's main-grad hooks see what they always see), the bias is added in the compute
dtype, and everything outside the linear layers keeps running under bf16 autocast.

cuBLAS wants the first operand row-major and the second column-major, K and N multiples of 16; the weight
gradient contracts over tokens, so its token dimension is zero-padded to a multiple of 16 when needed.
For backward the fp8 input (1 byte per element, not 2) is saved, and the weight is quantised again from
the parameter (the same amax, so the same scale) rather than keeping an fp8 copy per micro-batch in flight.
There is no host synchronisation (scales stay on the device), so the function traces under torch.compile.

`megaloom.precision.fp8_convert.convert_to_float8` switches the attention and MLP linears of the transformer
blocks: an ``nn.Linear`` becomes a `Float8Linear` (the same Parameter objects under the same names, so
checkpoints do not change); a tensor-parallel ``ColumnParallelLinear`` / ``RowParallelLinear`` gets
``fp8_recipe`` set and runs its local matmul in fp8 (`float8_linear`, handed to it by the pass) while its
collectives stay in bf16.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megaloom.accelerator import CUDA
from megaloom.precision.fp8_block import blockwise_matmul

RECIPES = ("tensorwise", "rowwise", "blockwise")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
EPS = 1e-12  # amax floor: an all-zero tensor gets a large finite scale instead of inf


def quantize(t: torch.Tensor, dtype: torch.dtype, dim: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(t in fp8, scale) with ``t8 ~= t * scale``; one fp32 scale (0-dim) or, with ``dim``, one per slice
    along ``dim`` (reduced, kept as a size-1 dimension). Saturating: values beyond fp8's range are clamped."""
    fmax = torch.finfo(dtype).max
    a = t.abs()
    amax = (a.amax() if dim is None else a.amax(dim=dim, keepdim=True)).float()
    scale = fmax / amax.clamp(min=EPS)
    return (t.float() * scale).clamp(-fmax, fmax).to(dtype), scale


def _col_major(t: torch.Tensor) -> torch.Tensor:
    """The same matrix stored column-major (what cuBLAS wants as the second operand)."""
    return t.t().contiguous().t()


def _pad_rows(t8: torch.Tensor, multiple: int = 16) -> torch.Tensor:
    """Zero rows appended up to a multiple (fp8 zero is byte 0; padded through a uint8 view)."""
    pad = -t8.shape[0] % multiple
    if pad == 0:
        return t8
    return F.pad(t8.view(torch.uint8), (0, 0, 0, pad)).view(t8.dtype)


def _pad_cols(t8: torch.Tensor, multiple: int = 16) -> torch.Tensor:
    """Row-major copy of ``t8`` with zero columns appended up to a multiple."""
    pad = -t8.shape[1] % multiple
    if pad == 0:
        return t8.contiguous()
    return F.pad(t8.view(torch.uint8), (0, pad)).view(t8.dtype)


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t in dtype, without a no-op .to(): under torch.compile (2.11) a custom Function returning such an alias of
    an intermediate lost its gradient (it came back as zeros)."""
    return t if t.dtype == dtype else t.to(dtype)


def _rowwise_mm(a8: torch.Tensor, b8: torch.Tensor, a_inv: torch.Tensor, b_inv: torch.Tensor,
                fast_accum: bool = False) -> torch.Tensor:
    """a8 @ b8 scaled by a_inv [M, 1] and b_inv [1, N], in bf16 (the CUDA rowwise kernel: fp32 accumulation, scales
    in the epilogue, bf16 out). CPU kernels before torch 2.13 take only per-tensor scales: the same arithmetic
    there with unit scales and the epilogue written out."""
    if a8.device.type == CUDA:
        return torch._scaled_mm(a8, b8, scale_a=a_inv, scale_b=b_inv, out_dtype=torch.bfloat16,
                                use_fast_accum=fast_accum)
    one = torch.ones((), device=a8.device)
    acc = torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.float32)
    return (acc * a_inv * b_inv).to(torch.bfloat16)


class _Float8Matmul(torch.autograd.Function):
    """y[M, N] = x[M, K] @ weight[N, K]^T in fp8, returned in ``dtype``; gradients in the inputs' dtypes."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, recipe: str, dtype: torch.dtype,
                fast_accum: bool = True) -> torch.Tensor:
        ctx.recipe, ctx.dtype, ctx.x_dtype = recipe, dtype, x.dtype
        if recipe == "tensorwise":
            x8, xs = quantize(x, E4M3)
            w8, ws = quantize(weight, E4M3)
            y = torch._scaled_mm(x8.contiguous(), w8.t(), scale_a=xs.reciprocal(), scale_b=ws.reciprocal(),
                                 out_dtype=dtype, use_fast_accum=fast_accum)
            ctx.save_for_backward(x8, xs, weight)
            return y
        x8, xs = quantize(x, E4M3, dim=1)  # [M, 1]
        w8, ws = quantize(weight, E4M3, dim=1)  # [N, 1]: one scale per output feature
        y = _rowwise_mm(x8.contiguous(), w8.t(), xs.reciprocal(), ws.reciprocal().view(1, -1), fast_accum=fast_accum)
        ctx.save_for_backward(_cast(x, dtype), weight)  # the weight gradient is a high-precision GEMM
        return _cast(y, dtype)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        if ctx.recipe == "tensorwise":
            x8, xs, weight = ctx.saved_tensors
            g8, gs = quantize(dy, E5M2)
            w8, ws = quantize(weight, E4M3)
            g8, g_inv, w_inv = g8.contiguous(), gs.reciprocal(), ws.reciprocal()
            dx = dw = None
            if ctx.needs_input_grad[0]:
                dx = torch._scaled_mm(g8, _col_major(w8), scale_a=g_inv, scale_b=w_inv, out_dtype=ctx.x_dtype)
            if ctx.needs_input_grad[1]:
                # contracts over tokens: both operands padded with zero tokens to a multiple of 16
                dw = torch._scaled_mm(_pad_cols(g8.t()), _col_major(_pad_rows(x8)), scale_a=g_inv,
                                      scale_b=xs.reciprocal(), out_dtype=torch.float32)
                dw = _cast(dw, weight.dtype)
            return dx, dw, None, None, None
        x_hp, weight = ctx.saved_tensors
        dx = dw = None
        if ctx.needs_input_grad[0]:
            g8, gs = quantize(dy, E4M3, dim=1)  # [M, 1]
            w8, ws = quantize(weight, E4M3, dim=0)  # [1, K]: one scale per column, along the contracted N
            dx = _cast(_rowwise_mm(g8.contiguous(), _col_major(w8), gs.reciprocal(), ws.reciprocal()), ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            dw = _cast(_cast(dy, x_hp.dtype).t() @ x_hp, weight.dtype)
        return dx, dw, None, None, None


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a linear layer would compute in here: the autocast dtype if autocast is on, else x's."""
    dev = x.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return x.dtype


def float8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  recipe: str = "tensorwise", fast_accum: bool = True) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with the matmul in fp8; x is [..., K], weight [N, K] (K, N multiples of 16
    on CUDA for tensorwise and rowwise; blockwise pads). The result has the dtype F.linear would give (bf16 under
    bf16 autocast). ``fast_accum``: the forward GEMM's accumulation (tensorwise, rowwise; blockwise always promotes
    its partial sums to fp32 per 128-wide block, as DeepSeek-V3 does)."""
    dtype = compute_dtype(x)
    k, n = weight.shape[1], weight.shape[0]
    with torch.autocast(x.device.type, enabled=False):
        if recipe == "blockwise":
            y = blockwise_matmul(x.reshape(-1, k), weight, dtype).view(*x.shape[:-1], n)
        else:
            y = _Float8Matmul.apply(x.reshape(-1, k), weight, recipe, dtype, fast_accum).view(*x.shape[:-1], n)
        if bias is not None:
            y = y + bias.to(dtype)
    return y


class Float8Linear(nn.Linear):
    """nn.Linear whose matmul runs in fp8 (`float8_linear`); parameters, names and init are nn.Linear's."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None,
                 recipe: str = "tensorwise", fast_accum: bool = True) -> None:
        super().__init__(in_features, out_features, bias, device, dtype)
        _check_recipe(recipe)
        self.fp8_recipe = recipe
        self.fp8_fast_accum = fast_accum

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: str = "tensorwise", fast_accum: bool = True) -> Float8Linear:
        """A Float8Linear holding the very same weight / bias Parameter objects as ``linear``."""
        with torch.device("meta"):
            new = cls(linear.in_features, linear.out_features, bias=False, recipe=recipe, fast_accum=fast_accum)
        new.weight = linear.weight
        new.bias = linear.bias
        new.train(linear.training)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return float8_linear(x, self.weight, self.bias, self.fp8_recipe, self.fp8_fast_accum)

    def extra_repr(self) -> str:
        accum = "" if self.fp8_fast_accum else ", fp32 accumulation"
        return f"{super().extra_repr()}, fp8={self.fp8_recipe}{accum}"


def _check_recipe(recipe: str) -> None:
    if recipe not in RECIPES:
        raise ValueError(f"fp8 recipe must be one of {RECIPES}, got {recipe!r}")
