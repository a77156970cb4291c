"""Blockwise FP8 (train.fp8_recipe=blockwise) and FP8 grouped experts (train.fp8_experts) on a GPU that has their
kernels (CUDA compute capability 9.x: Hopper): torch._scaled_mm's 1x128 / 128x128 block-scaled GEMM and
torch._scaled_grouped_mm against megaloom's fp32 emulation of the same GEMMs. Both dequantise the very same fp8
values, so they agree to the rounding of the bf16 outputs (and of Hopper's fast accumulation where it is on): a
wrong scale layout shows as tens of percent. Eager and compiled, forward and both gradients, shapes that need
padding; the start-up checks; tiny models trained by `megaloom.train` against bf16."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megaloom.config import load_config
from megaloom.precision import fp8_block, fp8_grouped
from megaloom.precision.fp8 import float8_linear
from megaloom.precision.fp8_block import EMULATED, KERNEL, blockwise_matmul
from megaloom.precision.fp8_grouped import Float8GroupedMM, float8_grouped_mm
from tests.conftest import tiny_overrides


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not _hopper(), reason="the block-scaled and grouped fp8 kernels need CUDA compute "
                                                       "capability 9.x (torch 2.11: SM90 only)")]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.fixture
def scaled_mm_calls(monkeypatch) -> list[int]:
    """Counts torch._scaled_mm calls (eager only: the custom op calls it at run time)."""
    calls, real = [], torch._scaled_mm

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", spy)
    return calls


@pytest.mark.parametrize("m,k,n", [(4096, 2048, 1024), (2000, 768, 640), (512, 1024, 6144)])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_blockwise_kernel_matches_the_emulation(m, k, n, x_dtype, scaled_mm_calls) -> None:
    torch.manual_seed(0)
    x = (torch.randn(m, k, device="cuda") * 2).to(x_dtype).requires_grad_()
    w = (torch.randn(n, k, device="cuda") * 0.02).requires_grad_()
    g = torch.randn(m, n, device="cuda", dtype=torch.bfloat16) * 1e-3
    assert fp8_block.backend_for(x.device) == KERNEL
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = float8_linear(x, w, None, "blockwise")
    y.backward(g)
    assert len(scaled_mm_calls) == 3  # the kernel ran all three GEMMs
    assert y.dtype == torch.bfloat16 and x.grad.dtype == x_dtype and w.grad.dtype == torch.float32
    xe, we = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ye = blockwise_matmul(xe, we, torch.bfloat16, EMULATED)
    ye.backward(g)
    for got, want in [(y, ye), (x.grad, xe.grad), (w.grad, we.grad)]:
        assert rel(got, want) < 1e-2, rel(got, want)
    # and fp8's own error against bf16: a few %
    xb, wb = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        yb = F.linear(xb, wb)
    yb.backward(g)
    assert rel(y, yb) < 0.06 and rel(x.grad, xb.grad) < 0.08 and rel(w.grad, wb.grad) < 0.08


def test_blockwise_kernel_compiled_equals_eager() -> None:
    torch._dynamo.reset()
    torch.manual_seed(1)
    x = torch.randn(2, 1000, 1024, device="cuda", requires_grad=True)
    w = (torch.randn(2048, 1024, device="cuda") * 0.02).requires_grad_()
    g = torch.randn(2, 1000, 2048, device="cuda", dtype=torch.bfloat16) * 1e-3
    out = []
    for fn in (float8_linear, torch.compile(float8_linear, fullgraph=True)):
        xa, wa = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = fn(xa, wa, None, "blockwise")
        y.backward(g)
        out.append((y, xa.grad, wa.grad))
    for a, b in zip(*out, strict=True):
        assert rel(a, b) < 1e-2 and a.dtype == b.dtype


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("fast_accum", [False, True])
def test_grouped_kernel_matches_the_emulation(compiled, fast_accum) -> None:
    torch._dynamo.reset()
    torch.manual_seed(2)
    counts = torch.tensor([900, 0, 37, 1500, 311, 64, 0, 1284], device="cuda")  # uneven, two experts idle
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    t, k, n = int(counts.sum()), 2048, 768
    x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16).requires_grad_()
    w = (torch.randn(8, k, n, device="cuda") * 0.02).requires_grad_()
    g = torch.randn(t, n, device="cuda", dtype=torch.bfloat16) * 1e-3
    assert fp8_grouped.backend_for(x.device) == KERNEL
    fn = torch.compile(float8_grouped_mm, fullgraph=True) if compiled else float8_grouped_mm
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = fn(x, w, offs, fast_accum)
    y.backward(g)
    assert y.dtype == torch.bfloat16 and x.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.float32
    xe, we = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ye = Float8GroupedMM.apply(xe, we, offs, torch.bfloat16, fast_accum, EMULATED)
    ye.backward(g)
    tol = 2e-2 if fast_accum else 1e-2  # Hopper's fast accumulation keeps ~14-bit partial sums over K = 2048
    for got, want in [(y, ye), (x.grad, xe.grad), (w.grad, we.grad)]:
        assert rel(got, want) < tol, rel(got, want)
    assert torch.all(w.grad[1] == 0) and torch.all(w.grad[6] == 0)


def test_start_up_checks_and_the_logged_backend() -> None:
    from megaloom.models import Transformer
    from megaloom.precision.fp8_convert import convert_to_float8

    fp8_block.check_kernel(torch.device("cuda"))
    fp8_grouped.check_kernel(torch.device("cuda"))
    cfg = load_config(None, ["model.preset=mixtral-tiny", "model.vocab_size=128", "train.precision=fp8"])
    with torch.device("meta"):
        model = Transformer(cfg.model)
    s = str(convert_to_float8(model, "blockwise", experts=True, device=torch.device("cuda")))
    assert "torch._scaled_mm with 1x128 / 128x128 block scales" in s and "torch._scaled_grouped_mm" in s, s


@pytest.mark.parametrize("extra", [
    ("train.fp8_recipe=blockwise",),
    ("train.fp8_recipe=blockwise", "train.compile=true", "train.fp8_keep_first_last=false"),
    ("model.preset=mixtral-tiny", "train.fp8_experts=true", "train.fp8_keep_first_last=false"),
    ("model.preset=mixtral-tiny", "train.fp8_experts=true", "train.fp8_recipe=blockwise", "train.compile=true"),
])
def test_tiny_model_trains_like_bf16(small_corpus, tmp_path, capsys, extra) -> None:
    from megaloom.train import train

    preset = [e for e in extra if e.startswith("model.preset")]
    common = ("model.n_layers=4", "train.steps=40", "checkpoint.every=0", "train.device=cuda", *preset)
    ref = train(load_config(None, tiny_overrides(small_corpus, tmp_path / "bf16", *common, "train.precision=bf16")))
    res = train(load_config(None, tiny_overrides(small_corpus, tmp_path / "fp8", *common, "train.precision=fp8",
                                                 *extra)))
    out = capsys.readouterr().out
    assert "emulated" not in out, out  # the kernels ran
    assert res.losses[40] < res.losses[1] - 1.0, res.losses
    assert abs(res.losses[40] - ref.losses[40]) < 0.15, (res.losses[40], ref.losses[40])
