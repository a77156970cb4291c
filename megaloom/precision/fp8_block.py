"""Block-scaled FP8 linears as DeepSeek-V3 trains them (``train.precision=fp8 train.fp8_recipe=blockwise``).

Every operand is e4m3 (the gradients too) with one fp32 scale per block, computed from the block at hand
(current scaling, ``scale = 448 / max(amax, 1e-12)``); the GEMM accumulates in fp32 and applies the two scales of
each 128-wide block of the contracted dimension as it goes, so one outlier spoils only its own block, not the tensor:

  GEMM                       left operand                       right operand
  forward   y  = x W^T       x in 1x128 tiles along K           W in 128x128 blocks
  grad-in   dx = dy W        dy in 1x128 tiles along N          W in 128x128 blocks (the forward's, transposed)
  grad-W    dW = dy^T x      dy^T in 1x128 tiles along tokens   x^T in 1x128 tiles along tokens

The weight-gradient GEMM contracts over tokens, so both its operands are quantised along tokens. x^T is quantised
for it in the forward, from the x the forward has (fp32 under autocast), and kept as fp8 tiles plus their scales
(about 1.03 bytes an element against bf16's 2): quantising it in backward from a bf16 copy rounds twice, and
torch.compile, which fuses the bf16 cast away, then quantised other values than eager did (weight gradients 1.3%
apart on the H200 and on CPU). The weight is
quantised again from the fp32 parameter in backward (the same blocks, so the same fp8 values) rather than kept in
fp8 per micro-batch in flight. Shapes need no alignment: every dimension is zero-padded up to whole blocks (zeros
add nothing to a product; their block gets a finite scale from the amax floor) and the result is cropped.

Two backends compute the same thing from the same fp8 values (`backend_for`):

- ``kernel``: ``torch._scaled_mm`` with 1x128 / 128x128 block scales, which torch infers from the scale tensors'
  shapes (cuBLAS >= 12.9, compute capability 9.x only; torch >= 2.9). The layouts it is given (`_kernel_mm`):
  left operand row-major with its 1x128 scales ``[M, K/128]`` outer-dim-major (strides ``(1, M)``); right
  operand column-major; 128x128 scales of the right operand ``[K/128, N/128]`` with strides ``(1, K/128)``,
  1x128 scales of the right operand ``[K/128, N]`` row-major. cuBLAS reads 128x128 scales with a leading
  dimension rounded up to a multiple of 4 blocks, which torch versions handled differently (some require that
  padding in the stride, some forbid it; pytorch#166752), so on this backend every contracted dimension is padded
  to a multiple of 512 (4 blocks): there both readings agree. The GEMM runs inside a custom op
  (``megaloom::fp8_block_mm``) so that torch.compile passes those layouts through untouched.
- ``emulated``: the blocks dequantised to fp32 and multiplied in fp32 (padding to 128 suffices). The reference the
  kernel is tested against, and the path on CPU and on GPUs without the kernel (Ada, Blackwell in torch 2.11):
  the numerics of blockwise fp8 training, not its speed. `megaloom.precision.fp8_convert` logs which one runs and,
  on the kernel, first checks it against the emulation on a small case (`check_kernel`): a layout torch reads
  differently fails there, with a message naming ``train.fp8_recipe``, instead of training on wrong numbers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megaloom import accelerator

BLOCK = 128
E4M3 = torch.float8_e4m3fn
FMAX = torch.finfo(E4M3).max  # 448
EPS = 1e-12  # amax floor: an all-zero block (padding included) gets a large finite scale
KERNEL, EMULATED = "kernel", "emulated"
KERNEL_PAD = 4 * BLOCK  # contracted dimensions on the kernel: whole groups of 4 blocks (module doc)


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def is_hopper(device: torch.device) -> bool:
    """A CUDA GPU of compute capability 9.x (asked inside compiled blocks: `accelerator.cuda_major` is a constant
    to torch.compile)."""
    return accelerator.cuda_major(device) == 9


def backend_for(device: torch.device) -> str:
    """``kernel`` where torch has a block-scaled fp8 GEMM (CUDA compute capability 9.x: Hopper), else ``emulated``."""
    return KERNEL if is_hopper(device) else EMULATED


def describe_backend(device: torch.device) -> str:
    """One line for the log: which backend runs blockwise GEMMs on ``device``, and what that means."""
    if backend_for(device) == KERNEL:
        return (f"blockwise GEMMs on torch._scaled_mm with 1x128 / 128x128 block scales (cuBLAS, "
                f"{_device_name(device)}; contracted dimensions padded to multiples of 512)")
    why = ("no block-scaled fp8 kernel on CPU" if not accelerator.is_accelerator(device) else
           f"no block-scaled fp8 kernel on {_device_name(device)}"
           + (" (torch's needs compute capability 9.x)" if accelerator.is_cuda(device) else ""))
    return (f"blockwise GEMMs emulated: {why}; the blocks are dequantised and multiplied in fp32 (the numerics of "
            "blockwise fp8, slower than bf16)")


def _device_name(device: torch.device) -> str:
    capability = accelerator.cuda_capability(device)
    if capability is None:
        return device.type
    return f"{accelerator.device_name(device)}, compute capability {capability[0]}.{capability[1]}"


# ------------------------------------------------------------------------------------------------ quantisation
def quantize_1x128(t: torch.Tensor, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` [r, c] zero-padded to [rows, cols] (cols a multiple of 128) and cast to e4m3 in 1x128 tiles along its
    columns: (t8 [rows, cols], inv [rows, cols / 128] fp32) with ``t ~= t8 * inv`` tile by tile. Saturating."""
    r, c = t.shape
    t = t.float()
    if (r, c) != (rows, cols):
        t = F.pad(t, (0, cols - c, 0, rows - r))
    tiles = t.reshape(rows, cols // BLOCK, BLOCK)
    scale = FMAX / tiles.abs().amax(dim=-1).clamp(min=EPS)
    t8 = (tiles * scale.unsqueeze(-1)).clamp(-FMAX, FMAX).to(E4M3).reshape(rows, cols)
    return t8, scale.reciprocal()


def quantize_128x128(w: torch.Tensor, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` [r, c] zero-padded to [rows, cols] (multiples of 128) and cast to e4m3 in 128x128 blocks:
    (w8 [rows, cols], inv [rows / 128, cols / 128] fp32) with ``w ~= w8 * inv`` block by block. Saturating."""
    r, c = w.shape
    w = w.float()
    if (r, c) != (rows, cols):
        w = F.pad(w, (0, cols - c, 0, rows - r))
    blocks = w.reshape(rows // BLOCK, BLOCK, cols // BLOCK, BLOCK)
    scale = FMAX / blocks.abs().amax(dim=(1, 3)).clamp(min=EPS)
    w8 = (blocks * scale[:, None, :, None]).clamp(-FMAX, FMAX).to(E4M3).reshape(rows, cols)
    return w8, scale.reciprocal()


def dequantize_1x128(t8: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    rows, cols = t8.shape
    return (t8.float().reshape(rows, cols // BLOCK, BLOCK) * inv.unsqueeze(-1)).reshape(rows, cols)


def dequantize_128x128(w8: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    rows, cols = w8.shape
    blocks = w8.float().reshape(rows // BLOCK, BLOCK, cols // BLOCK, BLOCK)
    return (blocks * inv[:, None, :, None]).reshape(rows, cols)


# ------------------------------------------------------------------------------------------------------ GEMM
@torch.library.custom_op("megaloom::fp8_block_mm", mutates_args=())
def _kernel_mm(a8: torch.Tensor, a_inv: torch.Tensor, b8: torch.Tensor, b_inv: torch.Tensor, b_square: bool,
               out_dtype: torch.dtype) -> torch.Tensor:
    """``torch._scaled_mm`` on block scales, the layouts arranged here (eager code, whatever strides torch.compile
    would have chosen): see `block_mm` for the arguments and the module doc for the layouts."""
    scale_a = a_inv.t().contiguous().t()  # [M, K/128], strides (1, M): outer-dim-major
    # right operand b8^T [K, N], column-major; its scales as torch._scaled_mm infers 128x128 / 1x128 from them
    scale_b = b_inv.contiguous().t() if b_square else b_inv.t().contiguous()  # [K/128, N/128] (1, K/128) | [K/128, N]
    try:
        return torch._scaled_mm(a8.contiguous(), b8.contiguous().t(), scale_a=scale_a, scale_b=scale_b,
                                out_dtype=out_dtype, use_fast_accum=False)
    except (RuntimeError, NotImplementedError, ValueError) as e:
        raise RuntimeError(
            f"train.fp8_recipe=blockwise: torch {torch.__version__}'s _scaled_mm refused the 1x128/128x128 block "
            f"scales on this GPU (A {tuple(a8.shape)}, B {tuple(b8.shape)}, scale_a {tuple(scale_a.shape)} strides "
            f"{scale_a.stride()}, scale_b {tuple(scale_b.shape)} strides {scale_b.stride()}): {e}. It needs an "
            "NVIDIA GPU of compute capability 9.x (Hopper), cuBLAS >= 12.9 and torch >= 2.9; use "
            "train.fp8_recipe=rowwise or tensorwise here.") from e


@_kernel_mm.register_fake
def _(a8, a_inv, b8, b_inv, b_square, out_dtype):
    return a8.new_empty((a8.shape[0], b8.shape[0]), dtype=out_dtype)


def block_mm(a8: torch.Tensor, a_inv: torch.Tensor, b8: torch.Tensor, b_inv: torch.Tensor, b_square: bool,
             out_dtype: torch.dtype, backend: str) -> torch.Tensor:
    """``A @ B^T`` [M, N] of block-quantised operands, fp32 accumulation, in ``out_dtype``: A ``a8`` [M, K] in 1x128
    tiles along K (``a_inv`` [M, K/128]); B ``b8`` [N, K] in 128x128 blocks (``b_square``, ``b_inv`` [N/128, K/128])
    or in 1x128 tiles along K (``b_inv`` [N, K/128]). ``backend``: `KERNEL` or `EMULATED` (module doc)."""
    if backend == KERNEL:
        return _kernel_mm(a8, a_inv, b8, b_inv, b_square, out_dtype)
    a = dequantize_1x128(a8, a_inv)
    b = dequantize_128x128(b8, b_inv) if b_square else dequantize_1x128(b8, b_inv)
    return (a @ b.t()).to(out_dtype)


def _gemm_dtype(dtype: torch.dtype) -> torch.dtype:
    """What the GEMM writes for a result wanted in ``dtype``: bf16 or fp32 (cuBLAS's block-scaled outputs)."""
    return torch.bfloat16 if dtype == torch.bfloat16 else torch.float32


def _finish(t: torch.Tensor, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """``t`` cropped to [rows, cols] in ``dtype``. A crop is copied, and a no-op cast skipped: an autograd Function
    that returns a view of an intermediate lost its gradient under torch.compile (2.11; see fp8._cast)."""
    if t.shape != (rows, cols):
        t = t[:rows, :cols].clone()
    return t if t.dtype == dtype else t.to(dtype)


class BlockwiseMatmul(torch.autograd.Function):
    """y [M, N] = x [M, K] @ weight [N, K]^T in blockwise fp8 (module doc), returned in ``dtype``; gradients in the
    inputs' dtypes (the weight's fp32)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype, backend: str) -> torch.Tensor:
        (m, k), n = x.shape, weight.shape[0]
        pad = KERNEL_PAD if backend == KERNEL else BLOCK
        mp, kp, np_ = round_up(m, pad), round_up(k, pad), round_up(n, pad)
        x8, x_inv = quantize_1x128(x, mp, kp)
        w8, w_inv = quantize_128x128(weight, np_, kp)
        y = block_mm(x8, x_inv, w8, w_inv, True, _gemm_dtype(dtype), backend)
        if ctx.needs_input_grad[1]:  # x^T [K, tokens] in tiles along tokens, for the weight gradient (module doc)
            xt8, xt_inv = quantize_1x128(x.t(), kp, mp)
            ctx.save_for_backward(weight, xt8, xt_inv)
        else:
            ctx.save_for_backward(weight)
        ctx.dtype, ctx.x_dtype, ctx.backend, ctx.padded, ctx.m = dtype, x.dtype, backend, (mp, kp, np_), m
        return _finish(y, m, n, dtype)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        # Autocast off, as in the forward (float8_linear): torch.compile traces this backward inside the caller's
        # autocast region, where the emulation's fp32 GEMMs would otherwise run in bf16.
        with torch.autocast(dy.device.type, enabled=False):
            return BlockwiseMatmul._backward(ctx, dy)

    @staticmethod
    def _backward(ctx, dy: torch.Tensor):
        weight, *xt = ctx.saved_tensors
        m, (n, k) = ctx.m, weight.shape
        mp, kp, np_ = ctx.padded
        dx = dw = None
        if ctx.needs_input_grad[0]:
            g8, g_inv = quantize_1x128(dy, mp, np_)  # tiles along N, the contracted dimension
            w8, w_inv = quantize_128x128(weight, np_, kp)  # the forward's blocks
            # B = W^T [K, N]: the same fp8 values transposed, its 128x128 block scales the transposed grid
            dx = block_mm(g8, g_inv, w8.t().contiguous(), w_inv.t(), True, _gemm_dtype(ctx.x_dtype), ctx.backend)
            dx = _finish(dx, m, k, ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            gt8, gt_inv = quantize_1x128(dy.t(), np_, mp)  # dy^T [N, tokens] in tiles along tokens
            xt8, xt_inv = xt  # x^T [K, tokens] likewise, from the forward
            dw = block_mm(gt8, gt_inv, xt8, xt_inv, False, torch.float32, ctx.backend)
            dw = _finish(dw, n, k, weight.dtype)
        return dx, dw, None, None


def blockwise_matmul(x: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype,
                     backend: str | None = None) -> torch.Tensor:
    """``x [M, K] @ weight [N, K]^T`` in blockwise fp8, in ``dtype``; ``backend`` None = `backend_for` x's device."""
    return BlockwiseMatmul.apply(x, weight, dtype, backend or backend_for(x.device))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


def kernel_disagreement(apply, x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor,
                        tolerance: float) -> tuple[str, float] | None:
    """The first of (forward, grad-input, grad-weight) where ``apply(x, w, backend)`` on the kernel and on the
    emulation differ by ``tolerance`` or more (relative norm), as (name, error); None when they agree. Both read
    the same fp8 values, so they agree to the outputs' bf16 rounding unless the kernel reads the scales otherwise."""
    got = {}
    for backend in (KERNEL, EMULATED):
        with torch.enable_grad(), torch.autocast(x.device.type, enabled=False):
            xb, wb = x.clone().requires_grad_(), w.clone().requires_grad_()
            y = apply(xb, wb, backend)
            y.backward(dy.to(y.dtype))
        got[backend] = (y, xb.grad, wb.grad)
    for name, a, b in zip(("forward", "grad-input", "grad-weight"), got[KERNEL], got[EMULATED], strict=True):
        err = _rel(a, b)
        if not err < tolerance:
            return name, err
    return None


def check_kernel(device: torch.device, tolerance: float = 1e-2) -> None:
    """The kernel against the emulation on ``device``, forward and both gradients of one small linear whose
    dimensions need padding (300 x 640 -> 384): a RuntimeError naming train.fp8_recipe when torch refuses the
    block scales or reads them differently from what the emulation computes (the two dequantise the same fp8
    values, so they agree to the bf16 rounding of the outputs)."""
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(300, 640, device=device, generator=gen)
    w = torch.randn(384, 640, device=device, generator=gen) * 0.05
    dy = torch.randn(300, 384, device=device, generator=gen)
    bad = kernel_disagreement(lambda a, b, backend: BlockwiseMatmul.apply(a, b, torch.bfloat16, backend),
                              x, w, dy, tolerance)
    if bad is not None:
        name, err = bad
        raise RuntimeError(
            f"train.fp8_recipe=blockwise: torch {torch.__version__}'s block-scaled _scaled_mm on "
            f"{_device_name(device)} disagrees with the dequantised reference ({name} GEMM: relative error "
            f"{err:.3g} > {tolerance}): the block scales are read in another layout than megaloom writes. "
            "Use train.fp8_recipe=rowwise or tensorwise, and report the torch version.")
