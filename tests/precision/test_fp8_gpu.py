"""FP8 on an FP8-capable GPU (compute capability >= 8.9: Ada, Hopper): the cuBLAS fp8 GEMMs (layouts, scales,
fast accumulation) against bf16 and a fake-quantised reference, under torch.compile, and a tiny model trained
by `megaloom.train` with train.precision=fp8."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megaloom.config import load_config
from megaloom.precision.fp8 import float8_linear
from tests.conftest import tiny_overrides
from tests.precision.test_fp8 import fake_quant, rel

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _fp8_gpu() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _fp8_gpu(), reason="needs a GPU of compute capability >= 8.9")]


def _case(x_dtype: torch.dtype, seed: int = 0):
    torch.manual_seed(seed)
    x = (torch.randn(2, 1000, 1024, device="cuda") * 2).to(x_dtype).requires_grad_()  # 2000 tokens: dW pads to 2016
    w = (torch.randn(2048, 1024, device="cuda") * 0.02).requires_grad_()
    g = torch.randn(2, 1000, 2048, device="cuda", dtype=torch.bfloat16) * 1e-3
    return x, w, g


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])  # fp32 residual stream or a bf16 activation
def test_fp8_gemms_close_to_bf16_and_to_the_reference(recipe, compiled, x_dtype) -> None:
    torch._dynamo.reset()
    x, w, g = _case(x_dtype)
    fn = torch.compile(float8_linear, fullgraph=True) if compiled else float8_linear
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = fn(x, w, None, recipe)
    y.backward(g)
    assert y.dtype == torch.bfloat16 and x.grad.dtype == x_dtype and w.grad.dtype == torch.float32
    xb, wb = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        yb = F.linear(xb, wb)
    yb.backward(g)
    assert rel(y, yb) < 0.05 and rel(x.grad, xb.grad) < 0.1 and rel(w.grad, wb.grad) < 0.1

    # the same operands quantised in fp32 and multiplied in fp64: catches a wrong layout or scale outright
    x2, g2, wd = x.detach().reshape(-1, 1024).float(), g.reshape(-1, 2048).float(), w.detach()
    if recipe == "tensorwise":
        xq, wq, gq = fake_quant(x2, E4M3), fake_quant(wd, E4M3), fake_quant(g2, E5M2)
        ry, rdx, rdw = xq @ wq.t(), gq @ wq, gq.t() @ xq
    else:
        ry = fake_quant(x2, E4M3, 1).double() @ fake_quant(wd, E4M3, 1).t().double()
        rdx = fake_quant(g2, E4M3, 1).double() @ fake_quant(wd, E4M3, 0).double()
        rdw = g2.bfloat16().t().double() @ x2.bfloat16().double()
    assert rel(y.reshape(-1, 2048), ry) < 1e-2  # bf16 output and fast accumulation
    assert rel(x.grad.reshape(-1, 1024), rdx) < 1e-2 and rel(w.grad, rdw) < 1e-2


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp32_accumulation_is_no_less_exact_than_fast_accumulation(recipe) -> None:
    """train.fp8_fast_accum=false: the forward GEMM promotes partial sums; over a long K (8192) its output is at
    least as close to the fp64 product of the same quantised operands."""
    torch.manual_seed(0)
    x = torch.randn(4096, 8192, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1024, 8192, device="cuda") * 0.02
    if recipe == "tensorwise":
        ref = fake_quant(x.float(), E4M3).double() @ fake_quant(w, E4M3).t().double()
    else:
        ref = fake_quant(x.float(), E4M3, 1).double() @ fake_quant(w, E4M3, 1).t().double()
    err = {}
    for fast in (True, False):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            err[fast] = rel(float8_linear(x, w, None, recipe, fast_accum=fast), ref)
    assert err[False] <= err[True] + 1e-4, err
    assert err[False] < 1e-2, err


@pytest.mark.parametrize("extra", [
    ("train.fp8_recipe=tensorwise",),
    ("train.fp8_recipe=rowwise",),
    ("train.fp8_recipe=tensorwise", "train.compile=true", "train.fp8_keep_first_last=false"),
    ("train.fp8_recipe=rowwise", "train.compile=true"),
    ("train.fp8_fast_accum=false", "train.fp8_keep_attention=true"),
])
def test_tiny_model_trains_in_fp8_like_bf16(small_corpus, tmp_path, capsys, extra) -> None:
    from megaloom.train import train

    common = ("model.n_layers=4", "train.steps=40", "checkpoint.every=0", "train.device=cuda")
    ref = train(load_config(None, tiny_overrides(small_corpus, tmp_path / "bf16", *common, "train.precision=bf16")))
    res = train(load_config(None, tiny_overrides(small_corpus, tmp_path / "fp8", *common, "train.precision=fp8",
                                                 *extra)))
    assert "linear layers in fp8" in capsys.readouterr().out
    assert res.losses[40] < res.losses[1] - 1.0, res.losses
    assert abs(res.losses[40] - ref.losses[40]) < 0.15, (res.losses[40], ref.losses[40])
    assert load_config(tmp_path / "fp8" / "config.yaml").train.precision == "fp8"


def test_moe_model_trains_in_fp8(small_corpus, tmp_path) -> None:
    from megaloom.train import train

    res = train(load_config(None, tiny_overrides(
        small_corpus, tmp_path / "moe", "model.preset=mixtral-tiny", "model.n_layers=4", "train.steps=30",
        "checkpoint.every=0", "train.precision=fp8", "train.fp8_keep_first_last=false")))
    assert res.losses[30] < res.losses[1] - 1.0, res.losses
