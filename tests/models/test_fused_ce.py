"""The fused, chunked linear + cross-entropy (megaloom.models.fused_ce) against the unfused head + loss."""

from __future__ import annotations

import functools
import time

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import megaloom.models.fused_ce as fused_ce
from megaloom.config import load_config
from megaloom.models import Transformer
from megaloom.models.fused_ce import FusedHeadLoss, default_chunk_tokens, linear_cross_entropy
from megaloom.models.transformer import cross_entropy
from megaloom.parallel.pipeline.partition import partition_layers
from megaloom.parallel.pipeline.split_backward import backward_input
from megaloom.parallel.pipeline.stage import PipelineStage

N, D, V = 50, 24, 300


def _data(dtype=torch.float32, seed=0, n=N, ignore=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, D, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(V, D, generator=g) * 0.3).requires_grad_()
    labels = torch.randint(0, V, (n,), generator=g)
    if ignore:
        labels[::7] = -100
    return x, w, labels


def _reference(x, w, labels, scale=1.0):
    loss = cross_entropy(F.linear(x, w), labels)  # megaloom's unfused head + loss
    gx, gw = torch.autograd.grad(loss * scale, (x, w))
    return loss.detach(), gx, gw


def _fused(x, w, labels, chunk, scale=1.0):
    loss = linear_cross_entropy(x, w, labels, chunk)
    gx, gw = torch.autograd.grad(loss * scale, (x, w))
    return loss.detach(), gx, gw


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.fixture(params=["inplace", "pure"])
def chunk_impl(request, monkeypatch):
    """Both per-chunk implementations: eager in-place (CPU, and under an outer compile) and the pure one that
    CUDA compiles (run eagerly here)."""
    impl = {"inplace": fused_ce._chunk_inplace, "pure": fused_ce._chunk_pure}[request.param]
    monkeypatch.setattr(fused_ce, "_chunk_function", lambda device: impl)
    return request.param


@pytest.mark.parametrize("chunk", [1, 7, 16, 49, 50, 64, None])
def test_fp32_loss_and_grads_match_unfused(chunk, chunk_impl):
    x, w, labels = _data()
    ref = _reference(x, w, labels, scale=0.37)
    out = _fused(x, w, labels, chunk, scale=0.37)
    assert out[0].dtype == torch.float32 and out[0].shape == ()
    assert abs(float(out[0]) - float(ref[0])) <= 1e-6 * abs(float(ref[0]))
    for a, b in zip(out[1:], ref[1:], strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert _rel(a, b) < 1e-6


def test_3d_input_and_ignored_tokens_count_only_valid():
    x, w, labels = _data()
    x3, l3 = x.detach().view(5, 10, D).requires_grad_(), labels.view(5, 10)
    loss = linear_cross_entropy(x3, w, l3, chunk_tokens=8)
    with torch.no_grad():
        ref = F.cross_entropy(F.linear(x3, w).float().view(-1, V), l3.reshape(-1), ignore_index=-100)
    assert abs(float(loss.detach()) - float(ref)) <= 1e-6 * float(ref)
    gx, = torch.autograd.grad(loss, x3)
    assert gx.shape == x3.shape and torch.all(gx.view(-1, D)[::7] == 0)  # ignored tokens get no gradient


def test_all_ignored_is_nan_like_the_reference(chunk_impl):
    x, w, labels = _data()
    labels = torch.full_like(labels, -100)
    ref = _reference(x, w, labels)
    out = _fused(x, w, labels, 16)
    assert torch.isnan(ref[0]) and torch.isnan(out[0])
    for a, b in zip(out[1:], ref[1:], strict=True):
        torch.testing.assert_close(a, b)


def test_tied_weights_accumulate_both_uses():
    """The head shares the embedding Parameter: its gradient is the lookup's plus the head's."""
    g = torch.Generator().manual_seed(1)
    emb = torch.nn.Embedding(V, D)
    torch.nn.init.normal_(emb.weight, 0, 0.3, generator=g)
    proj = torch.nn.Linear(D, D)
    tokens = torch.randint(0, V, (N,), generator=g)
    labels = torch.randint(0, V, (N,), generator=g)
    labels[3::11] = -100

    def run(fused: bool):
        emb.zero_grad(set_to_none=True)
        proj.zero_grad(set_to_none=True)
        h = torch.tanh(proj(emb(tokens)))
        loss = linear_cross_entropy(h, emb.weight, labels, 13) if fused else cross_entropy(F.linear(h, emb.weight),
                                                                                         labels)
        (loss * 0.5).backward()
        return loss.detach(), emb.weight.grad.clone(), proj.weight.grad.clone()

    ref, out = run(False), run(True)
    assert abs(float(out[0]) - float(ref[0])) <= 1e-6 * float(ref[0])
    assert _rel(out[1], ref[1]) < 1e-6 and _rel(out[2], ref[2]) < 1e-6


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_bf16_autocast_close_to_unfused_bf16(x_dtype, chunk_impl):
    x, w, labels = _data(x_dtype)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = _reference(x, w, labels, scale=2.0)
        out = _fused(x, w, labels, 16, scale=2.0)
    assert out[0].dtype == torch.float32
    assert out[1].dtype == x_dtype and out[2].dtype == torch.float32  # grad_W in the fp32 master dtype
    assert abs(float(out[0]) - float(ref[0])) < 2e-3 * float(ref[0])
    # The reference rounds ((p - onehot) / n) to bf16 and the whole grad_W to bf16; the fused path rounds
    # (p - onehot) and accumulates grad_W over chunks in fp32: equal to bf16 precision.
    assert _rel(out[1], ref[1]) < 1e-2 and _rel(out[2], ref[2]) < 1e-2
    # ... and the fused bf16 result is as close to the exact fp32 one as the unfused bf16 one is.
    exact = _reference(x.detach().float().requires_grad_(), w, labels, scale=2.0)
    assert _rel(out[2], exact[2]) < 2 * _rel(ref[2], exact[2]) + 1e-3


def test_no_grad_returns_the_loss_only():
    x, w, labels = _data()
    with torch.no_grad():
        loss = linear_cross_entropy(x, w, labels, 9)
    assert not loss.requires_grad
    assert abs(float(loss) - float(_reference(x, w, labels)[0])) <= 1e-6 * float(loss)


def test_backward_twice_with_retained_graph_gives_the_same_grads():
    """The zero-bubble pipeline split runs this node twice (input gradient, then weights)."""
    x, w, labels = _data()
    loss = linear_cross_entropy(x, w, labels, 16)
    a = torch.autograd.grad(loss, (x, w), retain_graph=True)
    b = torch.autograd.grad(loss, (x, w))
    for ga, gb in zip(a, b, strict=True):
        assert torch.equal(ga, gb)


class _MaxNumel(TorchDispatchMode):
    """The largest tensor any aten op creates (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.max_numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.max_numel = max(self.max_numel, t.numel())
        return out


def test_never_materialises_the_full_logits():
    n, chunk = 512, 64
    x, w, labels = _data(n=n)
    full = n * V
    with _MaxNumel() as mode:
        _reference(x, w, labels)
    assert mode.max_numel == full  # the probe sees the unfused [N, V] logits
    with _MaxNumel() as mode:
        _fused(x, w, labels, chunk)
    assert mode.max_numel == max(chunk * V, V * D, n * D) < full // 4


def test_default_chunk():
    assert default_chunk_tokens(128256) == 4096  # ~1 GiB of bf16 logits for llama3's vocabulary
    assert default_chunk_tokens(8192) == 65536
    assert default_chunk_tokens(10**7) == 256
    with pytest.raises(ValueError, match="chunk_tokens"):
        linear_cross_entropy(*_data(), chunk_tokens=-1)


@pytest.mark.slow  # ~25 s of inductor compilation on a 2-core CPU
def test_compiled_matches_eager():
    x, w, labels = _data()
    fn = torch.compile(functools.partial(linear_cross_entropy, chunk_tokens=16), backend="inductor", fullgraph=True)
    t0 = time.perf_counter()
    out = _fused_with(fn, x, w, labels)
    elapsed = time.perf_counter() - t0
    ref = _fused(x, w, labels, 16)
    torch.testing.assert_close(out[0], ref[0], rtol=1e-6, atol=0)
    assert _rel(out[1], ref[1]) < 1e-6 and _rel(out[2], ref[2]) < 1e-6
    assert elapsed < 120


def _fused_with(fn, x, w, labels):
    loss = fn(x, w, labels)
    gx, gw = torch.autograd.grad(loss, (x, w))
    return loss.detach(), gx, gw


def _tiny_model(tie: bool, vocab: int = 160) -> Transformer:
    cfg = load_config(None, [f"model.vocab_size={vocab}", "model.d_model=64", "model.n_layers=2", "model.n_heads=4",
                             "model.n_kv_heads=2", "model.ffn_dim=128", "model.max_seq_len=32", "train.seq_len=32",
                             f"model.tie_embeddings={tie}"])
    torch.manual_seed(0)
    return Transformer(cfg.model)


def test_pipeline_last_stage_uses_the_hook_and_split_backward():
    full = _tiny_model(tie=True)
    ref_stage = PipelineStage(_tiny_model(tie=True), partition_layers(2, 2), 1)
    full.loss = FusedHeadLoss(chunk_tokens=10)
    stage = PipelineStage(full, partition_layers(2, 2), 1)  # layer 1, norm, head (a tied copy), loss
    assert isinstance(stage.model.loss, FusedHeadLoss)
    x, y = torch.randn(2, 32, 64), torch.randint(0, 160, (2, 32))
    xa, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    loss = stage(xa, 0, y, 32)
    ref = ref_stage(xr, 0, y, 32)
    assert abs(float(loss.detach()) - float(ref.detach())) <= 1e-6 * float(ref.detach())
    loss.backward()
    ref.backward()
    assert _rel(xa.grad, xr.grad) < 1e-6
    grads = {n: p.grad.clone() for n, p in stage.model.named_parameters()}
    for n, p in ref_stage.model.named_parameters():
        assert _rel(grads[n], p.grad) < 1e-6, n
    # zero-bubble's split: input gradient first, weight gradients later, same values
    stage.model.zero_grad(set_to_none=True)
    xb = x.clone().requires_grad_()
    dx, pending = backward_input(stage(xb, 0, y, 32), None, xb, stage.chunk_parameters(0))
    pending.run()
    assert _rel(dx, xa.grad) < 1e-6
    for n, p in stage.model.named_parameters():
        assert _rel(p.grad, grads[n]) < 1e-6, n




@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("autocast", [True, False])
def test_cuda_compiled_chunk_matches_unfused(autocast):
    """On CUDA the per-chunk softmax / gradient is compiled; chunks that do not divide N, ignored labels."""
    g = torch.Generator(device="cuda").manual_seed(0)
    n, d, v = 3000, 256, 50000
    x = torch.randn(n, d, device="cuda", generator=g).requires_grad_()
    w = (torch.randn(v, d, device="cuda", generator=g) * 0.05).requires_grad_()
    labels = torch.randint(0, v, (n,), device="cuda", generator=g)
    labels[::9] = -100
    ctx = torch.autocast("cuda", dtype=torch.bfloat16) if autocast else torch.autocast("cuda", enabled=False)
    with ctx:
        ref = _reference(x, w, labels, scale=3.0)
        out = _fused(x, w, labels, 1024, scale=3.0)
    tol = 1e-2 if autocast else 1e-5
    assert abs(float(out[0]) - float(ref[0])) < tol * float(ref[0])
    assert out[1].dtype == torch.float32 and out[2].dtype == torch.float32
    assert _rel(out[1], ref[1]) < tol and _rel(out[2], ref[2]) < tol
