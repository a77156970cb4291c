"""FP8 for the grouped MoE experts (``train.precision=fp8 train.fp8_experts=true``): rowwise-scaled e4m3 grouped GEMMs.

`GroupedExperts` (megaloom/models/moe.py) runs every expert's SwiGLU on its contiguous rows of the dispatched
tokens: three grouped GEMMs ``x [T, K] @ w[e] [K, N]`` over the groups ``offs`` (cumulative row counts, int32).
`float8_grouped_mm` is one of them in fp8 with current rowwise scaling, torchao's "rowwise_with_gw_hp" recipe for
MoE, the one the dense ``rowwise`` linears use:

  GEMM                         left operand                        right operand
  forward   y  = x w[e]        x: e4m3, one scale per token        w[e]: e4m3, one scale per column (along K)
  grad-in   dx = dy w[e]^T     dy: e4m3, one scale per token       w[e]: e4m3, one scale per row (along N)
  grad-W    dw[e] = x^T dy     bf16 grouped GEMM (a sum over the expert's tokens: kept in high precision)

The weight gradient stays bf16 because its contracted dimension is the expert's tokens: an fp8 grouped GEMM there
needs every group's token count a multiple of 16 (megaloom's dropless dispatcher does not pad groups) and
per-group scales along tokens. Master weights stay fp32 and get fp32 gradients; x is saved in the compute dtype for
the weight gradient; the weight is quantised again from the parameter in backward.

Backends (`backend_for`): ``kernel`` = ``torch._scaled_grouped_mm`` (CUTLASS, CUDA compute capability 9.x; 2D
tokens x 3D stacked weights, the tokens row-major, each expert's weight column-major, scales fp32: ``[T]`` for the
tokens and ``[E, N]`` for the weights, output bf16), run inside the custom op ``megaloom::fp8_grouped_mm`` so that
torch.compile leaves those layouts alone; ``emulated`` = the operands dequantised and multiplied expert by expert
in fp32 (a host sync for the group sizes, as megaloom's looped bf16 fallback has): CPU, other GPUs, and the
reference the kernel is tested against. K and N must be multiples of 16 (config.py checks model.d_model and the
expert width before anything is built).
"""

from __future__ import annotations

import torch

from megaloom import accelerator
from megaloom.precision.fp8 import E4M3, compute_dtype, quantize
from megaloom.precision.fp8_block import EMULATED, KERNEL, is_hopper, kernel_disagreement

# the backends are fp8_block's (KERNEL, EMULATED): one start-up check compares either kind of GEMM


def backend_for(device: torch.device) -> str:
    """``kernel`` where torch has an fp8 rowwise grouped GEMM (CUDA compute capability 9.x), else ``emulated``."""
    return KERNEL if hasattr(torch, "_scaled_grouped_mm") and is_hopper(device) else EMULATED


def describe_backend(device: torch.device) -> str:
    if backend_for(device) == KERNEL:
        return "expert GEMMs on torch._scaled_grouped_mm (rowwise e4m3, weight gradient bf16)"
    where = ("this GPU (torch's kernel needs compute capability 9.x)" if accelerator.is_cuda(device)
             else device.type if accelerator.is_accelerator(device) else "CPU")
    return (f"expert GEMMs emulated: no fp8 grouped GEMM on {where}; dequantised and multiplied expert by expert in "
            "fp32 (the numerics of fp8 experts, slower than bf16)")


@torch.library.custom_op("megaloom::fp8_grouped_mm", mutates_args=())
def _kernel_grouped(a8: torch.Tensor, a_inv: torch.Tensor, bt8: torch.Tensor, b_inv: torch.Tensor,
                    offs: torch.Tensor, fast_accum: bool) -> torch.Tensor:
    """``torch._scaled_grouped_mm``: a8 [T, K] row-major, bt8 [E, N, K] contiguous (so ``bt8^T`` [E, K, N] is
    column-major per expert), a_inv [T], b_inv [E, N]; bf16 [T, N]."""
    try:
        out = torch._scaled_grouped_mm(a8.contiguous(), bt8.contiguous().transpose(-2, -1), a_inv.contiguous(),
                                       b_inv.contiguous(), offs=offs, out_dtype=torch.bfloat16,
                                       use_fast_accum=fast_accum)
        return out.contiguous()  # the layout the fake below promises torch.compile
    except (RuntimeError, NotImplementedError, ValueError) as e:
        raise RuntimeError(
            f"train.fp8_experts=true: torch {torch.__version__}'s _scaled_grouped_mm refused the expert GEMM "
            f"(tokens {tuple(a8.shape)}, weights {tuple(bt8.shape)}): {e}. Set train.fp8_experts=false.") from e


@_kernel_grouped.register_fake
def _(a8, a_inv, bt8, b_inv, offs, fast_accum):
    return a8.new_empty((a8.shape[0], bt8.shape[1]), dtype=torch.bfloat16)


def grouped_mm(a8: torch.Tensor, a_inv: torch.Tensor, bt8: torch.Tensor, b_inv: torch.Tensor, offs: torch.Tensor,
               fast_accum: bool, backend: str) -> torch.Tensor:
    """Rows ``offs[e-1]:offs[e]`` of A ``a8`` [T, K] (scales ``a_inv`` [T]) times ``bt8[e]^T`` ([E, N, K], scales
    ``b_inv`` [E, N], one per output column): [T, N], bf16 from the kernel, fp32 from the emulation."""
    if backend == KERNEL:
        return _kernel_grouped(a8, a_inv, bt8, b_inv, offs, fast_accum)
    a = a8.float() * a_inv[:, None]
    b = bt8.float() * b_inv[..., None]
    out = a.new_zeros(a.shape[0], b.shape[1])
    start = 0
    for e, end in enumerate(offs.tolist()):  # one host sync: the emulation's group sizes
        if end > start:
            out[start:end] = a[start:end] @ b[e].t()
        start = end
    return out


@torch.library.custom_op("megaloom::bf16_grouped_wgrad", mutates_args=())
def _kernel_wgrad(x: torch.Tensor, dy: torch.Tensor, offs: torch.Tensor, n_experts: int) -> torch.Tensor:
    """``torch._grouped_mm`` 2D x 2D, groups along the tokens: x^T [K, T] (column-major) times dy [T, N] -> fp32
    [E, K, N] (the bf16 path's own weight-gradient GEMM, as autograd runs it for torch._grouped_mm)."""
    xb, gb = x.to(torch.bfloat16).contiguous(), dy.to(torch.bfloat16).contiguous()
    return torch._grouped_mm(xb.t(), gb, offs=offs).float().contiguous()


@_kernel_wgrad.register_fake
def _(x, dy, offs, n_experts):
    return x.new_empty((n_experts, x.shape[1], dy.shape[1]), dtype=torch.float32)


def _grouped_wgrad(x: torch.Tensor, dy: torch.Tensor, offs: torch.Tensor, n_experts: int,
                   backend: str) -> torch.Tensor:
    """dw [E, K, N] = x_e^T dy_e per group, from bf16 (compute-dtype) operands: fp32 out."""
    if backend == KERNEL:
        return _kernel_wgrad(x, dy, offs, n_experts)
    dw = x.new_zeros(n_experts, x.shape[1], dy.shape[1], dtype=torch.float32)
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            dw[e] = x[start:end].float().t() @ dy[start:end].float()
        start = end
    return dw


class Float8GroupedMM(torch.autograd.Function):
    """y [T, N] = x[rows of e] [T, K] @ w[e] [E, K, N] per group, in fp8 (module doc); out in ``dtype``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, dtype: torch.dtype, fast_accum: bool,
                backend: str) -> torch.Tensor:
        x8, xs = quantize(x, E4M3, dim=1)  # [T, 1]: one scale per token, along K
        wt8, ws = quantize(w.transpose(-2, -1), E4M3, dim=-1)  # [E, N, 1]: one per output column, along K
        y = grouped_mm(x8, xs.reciprocal().view(-1), wt8.contiguous(), ws.reciprocal().squeeze(-1), offs,
                       fast_accum, backend)
        ctx.save_for_backward(x if x.dtype == dtype else x.to(dtype), w, offs)
        ctx.x_dtype, ctx.backend = x.dtype, backend
        return y if y.dtype == dtype else y.to(dtype)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, w, offs = ctx.saved_tensors
        dx = dw = None
        if ctx.needs_input_grad[0]:
            g8, gs = quantize(dy, E4M3, dim=1)  # [T, 1]: one scale per token, along N
            w8, ws = quantize(w, E4M3, dim=-1)  # [E, K, 1]: one per row of w[e] (an output column of dx), along N
            dx = grouped_mm(g8, gs.reciprocal().view(-1), w8.contiguous(), ws.reciprocal().squeeze(-1), offs,
                            False, ctx.backend)
            dx = dx if dx.dtype == ctx.x_dtype else dx.to(ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            dw = _grouped_wgrad(x, dy.to(x.dtype), offs, w.shape[0], ctx.backend)
            dw = dw if dw.dtype == w.dtype else dw.to(w.dtype)
        return dx, dw, None, None, None, None


def float8_grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, fast_accum: bool = True,
                      backend: str | None = None) -> torch.Tensor:
    """``x [T, K]`` (expert e's rows ``offs[e-1]:offs[e]``) times ``w[e]`` [E, K, N] in fp8: [T, N] in the compute
    dtype (bf16 under autocast). ``fast_accum``: the forward GEMM's fast accumulation (train.fp8_fast_accum);
    ``backend`` None = `backend_for` x's device."""
    dtype = compute_dtype(x)
    with torch.autocast(x.device.type, enabled=False):
        return Float8GroupedMM.apply(x, w, offs, dtype, fast_accum, backend or backend_for(x.device))


def check_kernel(device: torch.device, tolerance: float = 1e-2) -> None:
    """The kernel against the emulation on ``device`` (forward, both gradients; uneven groups and an empty one):
    a RuntimeError naming train.fp8_experts when torch refuses or disagrees."""
    gen = torch.Generator(device=device).manual_seed(0)
    counts = torch.tensor([70, 0, 131, 99], device=device)
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    x = torch.randn(300, 256, device=device, generator=gen)
    w = torch.randn(4, 256, 384, device=device, generator=gen) * 0.05
    dy = torch.randn(300, 384, device=device, generator=gen)
    bad = kernel_disagreement(lambda a, b, backend: Float8GroupedMM.apply(a, b, offs, torch.bfloat16, True, backend),
                              x, w, dy, tolerance)
    if bad is not None:
        name, err = bad
        raise RuntimeError(
            f"train.fp8_experts=true: torch {torch.__version__}'s _scaled_grouped_mm disagrees with the "
            f"dequantised reference ({name}: relative error {err:.3g} > {tolerance}). Set "
            "train.fp8_experts=false, and report the torch version.")
