"""Blockwise FP8 (train.fp8_recipe=blockwise: DeepSeek-V3's 1x128 / 128x128 block scaling) and FP8 grouped experts
(train.fp8_experts) on CPU, where both run their fp32 emulation: quantisation error bounds, the GEMMs against
independent fake-quantised references and against fp32, what block scaling buys over a tensor scale, the kernel
path's layouts against torch's own checks (with stand-in kernels), the trainer end to end, and the config."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from megaloom.config import ConfigError, load_config
from megaloom.precision import fp8_block, fp8_grouped
from megaloom.precision.fp8 import float8_linear, quantize
from megaloom.precision.fp8_block import (
    EMULATED,
    KERNEL,
    BlockwiseMatmul,
    dequantize_1x128,
    dequantize_128x128,
    quantize_1x128,
    quantize_128x128,
)
from megaloom.precision.fp8_grouped import Float8GroupedMM, float8_grouped_mm
from tests.conftest import tiny_overrides

E4M3 = torch.float8_e4m3fn
FMAX = 448.0


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def fake_quant_blocks(t: torch.Tensor, block_rows: int, block_cols: int) -> torch.Tensor:
    """Quantise-dequantise ``t`` in blocks of block_rows x block_cols (zero-padded to whole blocks, cropped back),
    written independently of the module under test."""
    r, c = t.shape
    pr, pc = math.ceil(r / block_rows) * block_rows, math.ceil(c / block_cols) * block_cols
    p = torch.zeros(pr, pc, dtype=torch.float64)
    p[:r, :c] = t.double()
    b = p.unflatten(1, (-1, block_cols)).unflatten(0, (-1, block_rows))  # [R, br, C, bc]
    amax = b.abs().amax(dim=(1, 3), keepdim=True).clamp(min=1e-12)
    scale = (FMAX / amax).float()
    q = (b.float() * scale).clamp(-FMAX, FMAX).to(E4M3).float() / scale
    return q.flatten(2, 3).flatten(0, 1)[:r, :c].float()


def reference(x2: torch.Tensor, w: torch.Tensor, g2: torch.Tensor):
    """(y, dx, dw) of blockwise y = x W^T: every GEMM's operands fake-quantised as DeepSeek-V3 tiles them."""
    wq = fake_quant_blocks(w, 128, 128)
    y = fake_quant_blocks(x2, 1, 128) @ wq.t()
    dx = fake_quant_blocks(g2, 1, 128) @ wq
    dw = fake_quant_blocks(g2.t(), 1, 128) @ fake_quant_blocks(x2.t(), 1, 128).t()  # both tiled along tokens
    return y, dx, dw


# ------------------------------------------------------------------------------------------------ quantisation
def test_1x128_round_trip_error_bound_and_tile_independence() -> None:
    torch.manual_seed(0)
    # tiles of very different magnitudes: each gets its own scale
    t = torch.randn(40, 300) * torch.logspace(-6, 4, 300)[None, :]
    t8, inv = quantize_1x128(t, 64, 384)
    assert t8.shape == (64, 384) and t8.dtype == E4M3 and inv.shape == (64, 3) and inv.dtype == torch.float32
    back = dequantize_1x128(t8, inv)
    assert torch.all(back[40:] == 0) and torch.all(back[:, 300:] == 0)  # the padding stays zero
    back = back[:40, :300]
    # e4m3: 3 mantissa bits, so a normal value is off by at most 2^-4 of itself; below the smallest normal (2^-6 of
    # the scaled range) by half a subnormal step, 2^-10, in the tile's scale
    tile_inv = inv[:40].repeat_interleave(128, dim=1)[:, :300]
    bound = torch.maximum(t.abs() * 2**-4, tile_inv * 2**-10) * (1 + 1e-6)
    assert torch.all((back - t).abs() <= bound)
    # each tile's largest magnitude lands on 448 exactly, and its scale is that amax / 448
    amax = F.pad(t, (0, 84)).reshape(40, 3, 128).abs().amax(-1)
    assert torch.allclose(inv[:40], amax / FMAX, rtol=1e-6)
    assert torch.equal(t8[:40].float().reshape(40, 3, 128).abs().amax(-1), torch.full((40, 3), FMAX))
    # a huge value in one tile changes no other tile's fp8 bytes
    t2 = t.clone()
    t2[5, 10] = 1e9
    u8, uinv = quantize_1x128(t2, 64, 384)
    same = torch.ones(64, 3, dtype=torch.bool)
    same[5, 0] = False
    assert torch.equal(uinv[same], inv[same])
    assert torch.equal(u8.view(torch.uint8).reshape(64, 3, 128)[same], t8.view(torch.uint8).reshape(64, 3, 128)[same])


def test_128x128_round_trip_error_bound() -> None:
    torch.manual_seed(1)
    w = torch.randn(200, 260) * 0.02
    w[:128, 128:256] *= 1e4  # one block 10^4 larger
    w8, inv = quantize_128x128(w, 256, 384)
    assert w8.shape == (256, 384) and inv.shape == (2, 3)
    back = dequantize_128x128(w8, inv)
    assert torch.all(back[200:] == 0) and torch.all(back[:, 260:] == 0)
    block_inv = inv.repeat_interleave(128, 0).repeat_interleave(128, 1)[:200, :260]
    bound = torch.maximum(w.abs() * 2**-4, block_inv * 2**-10) * (1 + 1e-6)
    assert torch.all((back[:200, :260] - w).abs() <= bound)
    # the other blocks keep their precision: a few % relative error, not the 10^4-times-coarser grid
    other = torch.ones(200, 260, dtype=torch.bool)
    other[:128, 128:256] = False
    assert rel(back[:200, :260][other], w[other]) < 0.04


def test_quantize_all_zero_blocks_stay_finite() -> None:
    t8, inv = quantize_1x128(torch.zeros(3, 128), 3, 128)
    assert torch.isfinite(inv).all() and t8.float().abs().sum() == 0
    w8, winv = quantize_128x128(torch.zeros(5, 7), 128, 128)
    assert torch.isfinite(winv).all() and w8.float().abs().sum() == 0


# ------------------------------------------------------------------------------------------------ the GEMMs
@pytest.mark.parametrize("shape", [(37, 200), (3, 11, 200), (256, 256)])  # tokens, K not multiples of 128
def test_blockwise_linear_matches_reference_and_fp32(shape) -> None:
    torch.manual_seed(0)
    n = 70
    x = (torch.randn(*shape) * 3).requires_grad_()
    w = (torch.randn(n, shape[-1]) * 0.05).requires_grad_()
    b = torch.randn(n).requires_grad_()
    y = float8_linear(x, w, b, "blockwise")
    g = torch.randn_like(y) * 1e-3
    y.backward(g)
    assert y.dtype == x.grad.dtype == w.grad.dtype == torch.float32 and y.shape == (*shape[:-1], n)

    x2, g2 = x.detach().reshape(-1, shape[-1]), g.reshape(-1, n)
    ry, rdx, rdw = reference(x2, w.detach(), g2)
    # the emulation multiplies the very values the reference does, in fp32: equal to fp32 rounding
    for got, want in [((y - b).detach().reshape(-1, n), ry), (x.grad.reshape(-1, shape[-1]), rdx), (w.grad, rdw)]:
        assert (got - want).abs().max() <= 1e-5 * want.abs().max(), (got - want).abs().max()
    assert torch.allclose(b.grad, g2.sum(0), rtol=1e-5, atol=1e-7)

    # against the exact fp32 linear: e4m3's 3 mantissa bits leave a few % in every GEMM, the gradients included
    xe, we = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    F.linear(xe, we, b.detach()).backward(g)
    ye = F.linear(xe.detach(), we.detach(), b.detach())
    assert rel(y, ye) < 0.05 and rel(x.grad, xe.grad) < 0.05 and rel(w.grad, we.grad) < 0.05


def test_blockwise_under_autocast_keeps_dtypes_and_traces_whole() -> None:
    torch.manual_seed(1)
    x = torch.randn(2, 16, 256, requires_grad=True)  # fp32 residual stream, as in the model
    w = torch.nn.Parameter(torch.randn(128, 256) * 0.05)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = float8_linear(x, w, None, "blockwise")
        ref = F.linear(x, w)
    assert y.dtype == torch.bfloat16
    y.float().pow(2).sum().backward()
    assert x.grad.dtype == torch.float32 and w.grad.dtype == torch.float32
    assert rel(y.float(), ref.float()) < 0.05

    torch._dynamo.reset()
    fn = torch.compile(lambda a, b: float8_linear(a, b, None, "blockwise"), backend="aot_eager", fullgraph=True)
    xc, wc = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    yc = fn(xc, wc)  # fullgraph: no graph break, no host sync
    yc.sum().backward()
    assert torch.equal(yc, float8_linear(x.detach(), w.detach(), None, "blockwise")) and wc.grad is not None


def test_compiled_blockwise_equals_eager_under_autocast() -> None:
    """Inductor under the caller's autocast computes what eager does. Two causes once put them 1.3% apart (weight
    gradients; the H200 and CPU alike): x^T quantised in backward from a bf16 copy, whose cast inductor fuses away
    (now quantised once in the forward, from the x at hand), and the emulated backward GEMMs traced inside the
    autocast region (the backward now turns autocast off, as the forward does)."""
    torch.manual_seed(1)
    x = torch.randn(2, 300, 256)
    w = torch.randn(384, 256) * 0.02
    g = torch.randn(2, 300, 384, dtype=torch.bfloat16) * 1e-3
    out = []
    torch._dynamo.reset()
    for fn in (float8_linear, torch.compile(float8_linear, fullgraph=True)):
        xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = fn(xa, wa, None, "blockwise")
        y.backward(g)
        out.append((y, xa.grad, wa.grad))
    for eager, compiled in zip(*out, strict=True):
        assert eager.dtype == compiled.dtype and rel(compiled, eager) < 1e-6, rel(compiled, eager)


def test_blockwise_keeps_fp8_tiles_of_x_for_the_weight_gradient() -> None:
    """What a blockwise linear saves for backward: the weight (the parameter itself) and x^T as e4m3 tiles with
    one fp32 scale per 128 tokens, about 1.03 bytes an element where a bf16 copy takes 2."""
    x = torch.randn(256, 512, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(128, 512) * 0.05)
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
        float8_linear(x, w, None, "blockwise")
    activations = [t for t in saved if t is not w]
    assert sorted(str(t.dtype) for t in activations) == ["torch.float32", "torch.float8_e4m3fn"]
    assert sum(t.numel() * t.element_size() for t in activations) == 256 * 512 * (1 + 4 / 128)

    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        float8_linear(x, w.detach(), None, "blockwise")  # a frozen weight: nothing of x is kept
    assert all(t.dtype != torch.float8_e4m3fn for t in saved)


def test_block_scaling_survives_the_outliers_that_ruin_a_tensor_scale() -> None:
    """Block scaling's point: one huge value sets the scale of its own block only. A 10^5 outlier token (or weight
    block) pushes a tensor scale so high that the other values fall into e4m3's subnormals or to zero."""
    torch.manual_seed(0)
    x, w = torch.randn(256, 512), torch.randn(384, 512) * 0.05
    rows = torch.arange(256) != 7
    err = {}
    for recipe in ("tensorwise", "blockwise"):
        clean = rel(float8_linear(x, w, None, recipe), x @ w.t())
        xo = x.clone()
        xo[7] *= 1e5  # one outlier token (a "massive activation")
        tok = rel(float8_linear(xo, w, None, recipe)[rows], (xo @ w.t())[rows])
        wo = w.clone()
        wo[:128, :128] *= 1e5  # one outlier 128x128 weight block
        blk = rel(float8_linear(x, wo, None, recipe)[:, 128:], (x @ wo.t())[:, 128:])
        err[recipe] = (clean, tok, blk)
    t_clean, t_tok, t_blk = err["tensorwise"]
    b_clean, b_tok, b_blk = err["blockwise"]
    assert t_clean < 0.05 and t_tok > 0.3 and t_blk > 0.3, err  # ruined: tens of % on every other output
    assert b_clean < 0.05 and b_tok < 1.05 * b_clean and b_blk < 1.05 * b_clean, err  # untouched

    # an outlier channel (one column of x, every token: where LLM activations keep theirs) costs a per-row scale its
    # whole row; a 1x128 tile only its 128 columns
    xc = x.clone()
    xc[:, 3] *= 1e6
    far = slice(128, 512)  # the channels outside the outlier's tile
    x8, xs = quantize(xc, E4M3, dim=1)
    rowwise_err = rel((x8.float() / xs)[:, far], xc[:, far])
    t8, inv = quantize_1x128(xc, 256, 512)
    block_err = rel(dequantize_1x128(t8, inv)[:, far], xc[:, far])
    assert rowwise_err > 0.3 and block_err < 0.04, (rowwise_err, block_err)  # measured 0.74 and 0.026


# ------------------------------------------------------------- the kernel path's layouts, with stand-in kernels
def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _is_1x128(t: torch.Tensor, s: torch.Tensor) -> bool:
    """torch's is_blockwise_1x128_scaling (aten/src/ATen/native/cuda/ScaledBlas.cpp): scale [rows, ceil(K/128)],
    outer-dim-major (strides (1, rows)); a size-1 dimension's stride is not checked."""
    rows, k = t.shape
    return (s.dim() == 2 and s.dtype == torch.float32 and tuple(s.shape) == (rows, _ceil(k, 128))
            and (s.shape[0] <= 1 or s.stride(0) == 1) and (s.shape[1] <= 1 or s.stride(1) == rows))


def _is_128x128(t: torch.Tensor, s: torch.Tensor, k_stride: int) -> bool:
    """torch's is_blockwise_128x128_scaling: scale [ceil(rows/128), ceil(K/128)], rows ``k_stride`` apart (some
    torch versions want ceil(K/128), others it rounded up to a multiple of 4), contiguous along K."""
    rows, k = t.shape
    return (s.dim() == 2 and tuple(s.shape) == (_ceil(rows, 128), _ceil(k, 128))
            and (s.shape[0] <= 1 or s.stride(0) == k_stride) and (s.shape[1] <= 1 or s.stride(1) == 1))


def _expand(s: torch.Tensor, rows: int, cols: int, block_rows: int) -> torch.Tensor:
    return s.repeat_interleave(block_rows, 0).repeat_interleave(128, 1)[:rows, :cols]


def fake_scaled_mm(a, b, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None, use_fast_accum=False):
    """torch._scaled_mm on CUDA as far as blockwise scaling goes: its layout checks, then the dequantised product.
    The right operand's scales are checked transposed, as torch's get_joint_scaling does."""
    (m, k), n = a.shape, b.shape[1]
    assert a.stride(1) == 1 and b.stride(0) == 1, "a row-major, b column-major (cuBLAS on SM90)"
    assert k % 16 == 0 and n % 16 == 0 and scale_a.shape[1] > 1  # one K block would be read as rowwise
    assert not use_fast_accum
    assert _is_1x128(a, scale_a), (scale_a.shape, scale_a.stride())
    bt, sbt = b.t(), scale_b.t()
    lk = _ceil(k, 128)
    if _is_128x128(bt, sbt, lk):
        assert _is_128x128(bt, sbt, _ceil(lk, 4) * 4), "both torch readings of the 128x128 stride must accept it"
        bq = bt.float() * _expand(sbt, n, k, 128)
    else:
        assert _is_1x128(bt, sbt), (scale_b.shape, scale_b.stride())
        bq = bt.float() * _expand(sbt, n, k, 1)
    return (a.float() * _expand(scale_a, m, k, 1)) @ bq.t()


def fake_scaled_grouped_mm(a, b, scale_a, scale_b, offs=None, bias=None, scale_result=None, out_dtype=None,
                           use_fast_accum=False):
    """torch._scaled_grouped_mm 2D x 3D rowwise: its checks (ScaledBlas/GroupedBlas.cpp), then the product."""
    assert a.dim() == 2 and b.dim() == 3 and a.stride(1) == 1 and b.stride(-2) == 1, "a row-major, b col-major"
    assert a.shape[1] % 16 == 0 and b.shape[-2] % 16 == 0 and b.shape[-1] % 16 == 0
    assert scale_a.dim() == 1 and scale_a.is_contiguous() and scale_a.shape[0] == a.shape[0]
    assert scale_b.dim() == 2 and scale_b.stride(1) == 1 and tuple(scale_b.shape) == (b.shape[0], b.shape[2])
    assert offs.dtype == torch.int32 and out_dtype == torch.bfloat16
    out, start = torch.zeros(a.shape[0], b.shape[2]), 0
    for e, end in enumerate(offs.tolist()):
        out[start:end] = (a[start:end].float() * scale_a[start:end, None]) @ (b[e].float() * scale_b[e])
        start = end
    return out.to(torch.bfloat16)


def fake_grouped_mm(a, b, offs=None, bias=None, out_dtype=None):
    """torch._grouped_mm 2D x 2D (the weight gradient): groups along the contracted dimension -> [E, M, N]."""
    assert a.dim() == 2 and b.dim() == 2 and a.dtype == b.dtype == torch.bfloat16
    out, start = torch.zeros(len(offs), a.shape[0], b.shape[1]), 0
    for e, end in enumerate(offs.tolist()):
        out[e] = a[:, start:end].float() @ b[start:end].float()
        start = end
    return out.to(torch.bfloat16)


@pytest.fixture
def stand_in_kernels(monkeypatch):
    monkeypatch.setattr(torch, "_scaled_mm", fake_scaled_mm)
    monkeypatch.setattr(torch, "_scaled_grouped_mm", fake_scaled_grouped_mm, raising=False)
    monkeypatch.setattr(torch, "_grouped_mm", fake_grouped_mm, raising=False)


@pytest.mark.parametrize("m,k,n", [(300, 640, 384), (512, 512, 1024), (40, 96, 16)])
def test_kernel_path_layouts_pass_torchs_checks_and_match_the_emulation(stand_in_kernels, m, k, n) -> None:
    """The scale shapes and strides megaloom hands torch._scaled_mm (padding to 512, the transposed weight blocks of
    the grad-input GEMM, the token tiles of the weight gradient) pass torch's layout checks, and the products
    read through them equal the emulation's."""
    torch.manual_seed(0)
    x, w, dy = torch.randn(m, k), torch.randn(n, k) * 0.05, torch.randn(m, n)
    out = {}
    for backend in (KERNEL, EMULATED):
        xb, wb = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = BlockwiseMatmul.apply(xb, wb, torch.float32, backend)
        y.backward(dy)
        out[backend] = (y, xb.grad, wb.grad)
    for got, want in zip(out[KERNEL], out[EMULATED], strict=True):
        assert got.shape == want.shape and rel(got, want) < 1e-5
    fp8_block.check_kernel(torch.device("cpu"))  # the start-up check passes on these layouts


def test_kernel_check_catches_a_misread_scale_layout(monkeypatch) -> None:
    """A torch that read the weight's block scales transposed would train on wrong numbers; the start-up check
    refuses instead, naming the key."""
    def misreading(a, b, scale_a, scale_b, **kw):
        if scale_b.shape[0] != scale_b.shape[1] and scale_b.stride(0) == 1:  # a 128x128 right operand
            scale_b = scale_b.flip(0)
        return fake_scaled_mm(a, b, scale_a, scale_b, **kw)

    monkeypatch.setattr(torch, "_scaled_mm", misreading)
    with pytest.raises(RuntimeError, match="train.fp8_recipe=blockwise"):
        fp8_block.check_kernel(torch.device("cpu"))

    def refusing(*args, **kw):
        raise RuntimeError("Invalid scaling configuration")

    monkeypatch.setattr(torch, "_scaled_mm", refusing)
    with pytest.raises(RuntimeError, match="train.fp8_recipe=blockwise.*rowwise or tensorwise"):
        fp8_block.check_kernel(torch.device("cpu"))


def test_grouped_kernel_path_matches_the_emulation(stand_in_kernels) -> None:
    fp8_grouped.check_kernel(torch.device("cpu"))
    torch.manual_seed(2)
    counts = torch.tensor([5, 0, 40, 19])
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    x, w = torch.randn(64, 32), torch.randn(4, 32, 48) * 0.1
    ys = [Float8GroupedMM.apply(x, w, offs, torch.bfloat16, True, b) for b in (KERNEL, EMULATED)]
    assert rel(ys[0], ys[1]) < 1e-2


def test_backend_choice_is_explicit(monkeypatch) -> None:
    cpu = torch.device("cpu")
    assert fp8_block.backend_for(cpu) == EMULATED == fp8_grouped.backend_for(cpu)
    assert "emulated" in fp8_block.describe_backend(cpu) and "emulated" in fp8_grouped.describe_backend(cpu)
    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch, "_scaled_grouped_mm", fake_scaled_grouped_mm, raising=False)
    assert fp8_block.backend_for(gpu) == KERNEL == fp8_grouped.backend_for(gpu)
    for cap in [(8, 9), (10, 0), (12, 0)]:  # Ada; Blackwell: torch 2.11's block-scaled GEMM is SM90-only
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=cap: c)
        assert fp8_block.backend_for(gpu) == EMULATED == fp8_grouped.backend_for(gpu)


# --------------------------------------------------------------------------------------------- grouped experts
def test_fp8_grouped_mm_matches_reference_and_fp32() -> None:
    torch.manual_seed(0)
    counts = torch.tensor([7, 0, 30, 13])  # uneven, one expert without tokens
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    x = (torch.randn(50, 64) * 2).requires_grad_()
    w = (torch.randn(4, 64, 96) * 0.05).requires_grad_()
    y = float8_grouped_mm(x, w, offs)
    g = torch.randn_like(y)
    y.backward(g)
    assert y.dtype == x.grad.dtype == w.grad.dtype == torch.float32 and y.shape == (50, 96)

    def fq(t: torch.Tensor, dim: int) -> torch.Tensor:  # rowwise fake quantisation along ``dim``
        amax = t.abs().amax(dim=dim, keepdim=True).clamp(min=1e-12)
        return (t * (FMAX / amax)).clamp(-FMAX, FMAX).to(E4M3).float() / (FMAX / amax)

    xd, wd = x.detach(), w.detach()
    ry, rdx, rdw, start = torch.zeros(50, 96), torch.zeros(50, 64), torch.zeros(4, 64, 96), 0
    for e, end in enumerate(offs.tolist()):
        ry[start:end] = fq(xd, 1)[start:end] @ fq(wd[e], 0)  # tokens per row, weights per column, along K
        rdx[start:end] = fq(g, 1)[start:end] @ fq(wd[e], 1).t()  # ... along N for the grad-input GEMM
        rdw[e] = xd[start:end].t() @ g[start:end]  # the weight gradient in high precision
        start = end
    for got, want in [(y.detach(), ry), (x.grad, rdx), (w.grad, rdw)]:
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    assert torch.all(w.grad[1] == 0)

    ye, dxe, start = torch.zeros(50, 96), torch.zeros(50, 64), 0
    for e, end in enumerate(offs.tolist()):
        ye[start:end], dxe[start:end] = xd[start:end] @ wd[e], g[start:end] @ wd[e].t()
        start = end
    assert rel(y, ye) < 0.05 and rel(x.grad, dxe) < 0.05


def test_experts_in_fp8_match_the_plain_experts() -> None:
    from megaloom.models.moe import GroupedExperts

    torch.manual_seed(3)
    ex = GroupedExperts(4, 64, 96)
    ex.reset_parameters(0.05)
    x, counts = torch.randn(40, 64), torch.tensor([10, 0, 25, 5])
    ref = ex(x, counts)
    ex.fp8_mm = float8_grouped_mm
    y = ex(x, counts)
    assert rel(y, ref) < 0.08 and "fp8" in repr(ex)


# ------------------------------------------------------------------------------------------- trainer, config
def test_tiny_model_trains_with_blockwise_fp8(small_corpus, tmp_path, monkeypatch, capsys) -> None:
    """The trainer's blockwise path end to end on CPU (the FP8-GPU check bypassed; the emulation, logged)."""
    from megaloom.train import train

    monkeypatch.setattr("megaloom.training.trainer.resolve_precision", lambda cfg, device: "fp8")
    cfg = load_config(None, tiny_overrides(small_corpus, tmp_path / "run", "model.n_layers=4", "train.steps=16",
                                           "checkpoint.every=0", "train.fp8_recipe=blockwise"))
    res = train(cfg)
    out = capsys.readouterr().out
    assert "fp8 (blockwise): 14 linear layers in fp8" in out and "blockwise GEMMs emulated" in out
    assert res.losses[16] < res.losses[1] - 0.5, res.losses


def test_tiny_moe_trains_with_fp8_experts(small_corpus, tmp_path, monkeypatch, capsys) -> None:
    from megaloom.train import train

    monkeypatch.setattr("megaloom.training.trainer.resolve_precision", lambda cfg, device: "fp8")
    cfg = load_config(None, tiny_overrides(
        small_corpus, tmp_path / "moe", "model.preset=mixtral-tiny", "model.n_layers=4", "train.steps=16",
        "checkpoint.every=0", "train.precision=fp8", "train.fp8_experts=true", "train.fp8_keep_first_last=false",
        "train.fp8_recipe=blockwise"))
    res = train(cfg)
    out = capsys.readouterr().out
    assert "experts in fp8 (rowwise, train.fp8_experts): 2 MoE layers" in out and "expert GEMMs emulated" in out
    assert res.losses[16] < res.losses[1] - 0.5, res.losses


def test_fp8_config_refusals() -> None:
    assert load_config(None, ["train.precision=fp8", "train.fp8_recipe=blockwise"]).train.fp8_recipe == "blockwise"
    # shapes are padded, not refused: a model whose widths are no multiples of 128 is accepted
    load_config(None, ["train.precision=fp8", "train.fp8_recipe=blockwise", "model.d_model=96", "model.n_heads=3",
                       "model.n_kv_heads=1", "model.ffn_dim=200"])
    with pytest.raises(ConfigError, match="blockwise"):  # the choices are listed
        load_config(None, ["train.fp8_recipe=block"])
    assert load_config(None, ["model.preset=mixtral-tiny", "train.precision=fp8",
                              "train.fp8_experts=true"]).train.fp8_experts is True
    with pytest.raises(ConfigError, match="needs train.precision=fp8"):
        load_config(None, ["model.preset=mixtral-tiny", "train.precision=bf16", "train.fp8_experts=true"])
    with pytest.raises(ConfigError, match="no MoE layers"):
        load_config(None, ["train.precision=fp8", "train.fp8_experts=true"])
    with pytest.raises(ConfigError, match="multiples of 16"):
        load_config(None, ["model.preset=mixtral-tiny", "train.precision=fp8", "train.fp8_experts=true",
                           "model.expert_ffn_dim=72"])
    with pytest.raises(ConfigError, match=r"per tensor-parallel rank \(24"):  # 96 / tp 4: each rank's shard
        load_config(None, ["model.preset=mixtral-tiny", "train.precision=fp8", "train.fp8_experts=true",
                           "model.expert_ffn_dim=96", "parallel.tp=4"])
