"""CUDA-only paths that one GPU can check: forked dropout streams on the CUDA generator, their replay under
activation checkpointing, and the vocab-parallel loss on the device."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from megaloom.parallel.random import ForkedDropout, RNGTracker
from megaloom.parallel.vocab_ce import vocab_parallel_cross_entropy

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_cuda_forked_streams() -> None:
    dev = torch.device("cuda")
    a, b = RNGTracker({"tp": 0}, dev), RNGTracker({"tp": 1}, dev)
    torch.manual_seed(0)
    with a.fork():
        ra = torch.rand(64, device=dev)
    after_fork = torch.rand(64, device=dev)
    torch.manual_seed(0)
    with b.fork():
        rb = torch.rand(64, device=dev)
    torch.manual_seed(0)
    untouched = torch.rand(64, device=dev)
    assert not torch.equal(ra, rb)
    assert torch.equal(after_fork, untouched)  # the fork restored the CUDA generator


def test_cuda_dropout_replays_under_checkpoint() -> None:
    dev = torch.device("cuda")
    drop = ForkedDropout(0.5, RNGTracker({"tp": 3}, dev))
    w = torch.randn(256, 256, device=dev)

    def f(x: torch.Tensor) -> torch.Tensor:
        return drop(x * 2) * w

    x = torch.randn(256, 256, device=dev, requires_grad=True)
    torch.manual_seed(1)
    y1 = f(x).sum()
    y1.backward()
    g1, x.grad = x.grad, None
    torch.manual_seed(1)
    y2 = checkpoint(f, x, use_reentrant=False).sum()
    y2.backward()
    assert torch.equal(y1, y2) and torch.equal(g1, x.grad)


def test_cuda_vocab_ce_bf16() -> None:
    logits = (torch.randn(64, 512, device="cuda") * 3).bfloat16().requires_grad_()
    labels = torch.randint(0, 500, (64,), device="cuda")
    loss = vocab_parallel_cross_entropy(logits, labels, None)
    ref_in = logits.detach().float().requires_grad_()
    ref = F.cross_entropy(ref_in, labels)
    loss.backward()
    ref.backward()
    assert loss.dtype == torch.float32 and abs(loss.item() - ref.item()) < 1e-4
    assert torch.allclose(logits.grad.float(), ref_in.grad, atol=1e-3)
