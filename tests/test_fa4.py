"""train.attention=fa4: FA4's forward and backward wrapped as custom ops (megaloom/fa4.py). The kernel itself
needs a Hopper GPU and the flash-attn-4 package (speed and loss on the H200: bench/RESULTS.md); here a reference
kernel in FA4's calling convention ([B, T, H, D], key/value heads shared, log-sum-exp [B, H, T]) stands in for it,
so the wrapper's layout, scale, grouped-query heads, autograd formula and fake shapes are checked against SDPA."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import megaloom.fa4 as fa4
from megaloom.config import ConfigError, load_config
from megaloom.step import attention_ctx


def _reference_fwd(q, k, v, softmax_scale, causal, return_lse):
    """Attention in FA4's layout and return convention (out, lse, then three optional tensors)."""
    assert causal and return_lse
    rep = q.shape[2] // k.shape[2]
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)))
    scores = (qh @ kh.transpose(-1, -2)).float() * softmax_scale
    t = q.shape[1]
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), -math.inf)
    lse = scores.logsumexp(-1)
    out = (torch.softmax(scores, -1).to(vh.dtype) @ vh).transpose(1, 2)
    return out, lse, None, None, None


def _reference_bwd(q, k, v, out, dout, lse, softmax_scale, causal):
    """FlashAttention's backward by its formula (custom-op bodies run below autograd, so no autograd here)."""
    rep = q.shape[2] // k.shape[2]
    qh, kh, vh, oh, doh = (t.transpose(1, 2).float() for t in
                           (q, k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2), out, dout))
    t = q.shape[1]
    scores = (qh @ kh.transpose(-1, -2)) * softmax_scale
    p = (scores - lse.unsqueeze(-1)).exp().masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), 0.0)
    dv = p.transpose(-1, -2) @ doh
    dp = doh @ vh.transpose(-1, -2)
    ds = p * (dp - (doh * oh).sum(-1, keepdim=True))
    dq, dk = ds @ kh * softmax_scale, ds.transpose(-1, -2) @ qh * softmax_scale

    def back(g, like):  # [B, H, T, D] -> FA4's layout, the shared key/value heads' gradients summed
        g = g.transpose(1, 2)
        return g.unflatten(2, (like.shape[2], -1)).sum(3).to(like.dtype) if g.shape[2] != like.shape[2] \
            else g.to(like.dtype)
    return back(dq, q), back(dk, k), back(dv, v)


@pytest.fixture
def reference_kernel(monkeypatch):
    monkeypatch.setattr(fa4, "_interface", lambda: SimpleNamespace(_flash_attn_fwd=_reference_fwd,
                                                                   _flash_attn_bwd=_reference_bwd))


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_wrapper_matches_sdpa_forward_and_backward(reference_kernel, kv_heads):
    torch.manual_seed(0)
    q = torch.randn(2, 4, 16, 8, requires_grad=True)  # SDPA layout [B, H, T, D], as the model calls it
    k, v = (torch.randn(2, kv_heads, 16, 8, requires_grad=True) for _ in range(2))
    grad = torch.randn(2, 4, 16, 8)
    out = fa4.fa4_causal_attention(q, k, v)
    out.backward(grad)
    got = [out.detach(), q.grad, k.grad, v.grad]
    for t in (q, k, v):
        t.grad = None
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kv_heads != 4)
    ref.backward(grad)
    for a, b in zip(got, [ref.detach(), q.grad, k.grad, v.grad], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_wrapper_traces_under_compile(reference_kernel):
    """The fake versions give compile the shapes (aot_eager: AOTAutograd's tracing without Inductor's codegen)."""
    q, k, v = (torch.randn(1, h, 8, 8, requires_grad=True) for h in (4, 2, 2))
    out = torch.compile(fa4.fa4_causal_attention, backend="aot_eager", fullgraph=True)(q, k, v)
    out.sum().backward()
    assert out.shape == q.shape and k.grad.shape == k.shape


def test_the_model_routes_its_causal_core_to_fa4(reference_kernel, monkeypatch):
    """With train.attention=fa4 the blocks' plain causal core calls the kernel (under bf16 autocast) and trains
    like SDPA; the options leave it off for every other value."""
    from megaloom.models.attention import Attention
    from megaloom.models.transformer import build_on_device
    from megaloom.training.options import apply_train_options

    cfg = load_config(None, ["model.preset=tiny", "model.vocab_size=256", "train.attention=fa4",
                             "train.precision=bf16"])
    torch.manual_seed(0)
    model = build_on_device(cfg.model, torch.device("cpu"))
    apply_train_options(model, cfg.train)
    attn = [m for m in model.modules() if isinstance(m, Attention)]
    assert attn and all(m.fa4 for m in attn)
    calls = []
    monkeypatch.setattr(fa4, "_interface", lambda: SimpleNamespace(
        _flash_attn_fwd=lambda *a, **kw: calls.append(1) or _reference_fwd(*a, **kw),
        _flash_attn_bwd=_reference_bwd))
    x = torch.randint(0, cfg.model.vocab_size, (2, 32))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss_fa4 = model(x, x)
    assert len(calls) == cfg.model.n_layers
    for m in attn:
        m.fa4 = False
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss_sdpa = model(x, x)
    torch.testing.assert_close(loss_fa4, loss_sdpa, rtol=2e-2, atol=2e-2)
    apply_train_options(model, load_config(None, ["train.attention=cudnn"]).train)
    assert not any(m.fa4 for m in attn)


def test_head_sizes_fa4_does_not_take_keep_sdpa():
    assert fa4.fa4_takes(64) and fa4.fa4_takes(128) and fa4.fa4_takes(8)
    assert not fa4.fa4_takes(256) and not fa4.fa4_takes(60) and not fa4.fa4_takes(4)


def test_fa4_refused_on_cpu_with_the_fix():
    assert load_config(None, ["train.attention=fa4"]).train.attention == "fa4"
    assert "CUDA GPU" in fa4.fa4_problem(torch.device("cpu"))
    with pytest.raises(ConfigError, match="train.attention=fa4: it needs a CUDA GPU. Use train.attention=cudnn"):
        fa4.check_fa4(torch.device("cpu"))
    with attention_ctx("fa4", torch.device("cpu")):  # the kernel preference applies to CUDA only
        q = torch.randn(1, 2, 8, 16)
        F.scaled_dot_product_attention(q, q, q, is_causal=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or fa4.fa4_problem(torch.device("cuda")) is not None,
                    reason="needs a Hopper/Blackwell GPU with flash-attn-4 installed")
@pytest.mark.parametrize("compiled", [False, True])
def test_fa4_kernel_matches_cudnn_on_the_gpu(compiled: bool) -> None:
    """The real kernel, eager and inside a compiled function: output and input gradients within bf16 rounding of
    cuDNN's SDPA at llama3-1b's heads (32 query, 8 key/value heads of 64)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    dev = torch.device("cuda")
    q, k, v = (torch.randn(2, h, 1024, 64, device=dev, dtype=torch.bfloat16, requires_grad=True) for h in (32, 8, 8))
    grad = torch.randn(2, 32, 1024, 64, device=dev, dtype=torch.bfloat16)
    fn = torch.compile(fa4.fa4_causal_attention, fullgraph=True) if compiled else fa4.fa4_causal_attention
    out = fn(q, k, v)
    out.backward(grad)
    got = [out.detach(), q.grad, k.grad, v.grad]
    for t in (q, k, v):
        t.grad = None
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    ref.backward(grad)
    for a, b in zip(got, [ref.detach(), q.grad, k.grad, v.grad], strict=True):  # bf16 rounding: ~0.4% per element
        assert float((a.float() - b.float()).norm() / b.float().norm()) < 1e-2
