"""The GPU paths in one process: fused AdamW over shard segments (step counters on the device), LAMB, the
CUDA allocator seeing ZeRO-2 release the full gradient buckets. The multi-rank tests pick NCCL by
themselves when a host has one GPU per rank."""

from __future__ import annotations

import copy

import pytest
import torch

from megaloom.models import Transformer
from megaloom.optim.lamb import build_lamb
from megaloom.optim.param_groups import param_groups
from megaloom.optim.zero import ShardedOptimizer
from megaloom.parallel.data_parallel import DataParallelGrads
from megaloom.parallel.mesh import Mesh

from ..worlds import SEQ, VOCAB, tiny_config

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("zero,kind", [(0, "adamw"), (1, "adamw"), (2, "adamw"), (1, "lamb")])
def test_sharded_optimizer_on_cuda_matches_plain(zero: int, kind: str) -> None:
    device = torch.device("cuda")
    torch.manual_seed(0)
    ref = Transformer(tiny_config().model).to(device)
    model = copy.deepcopy(ref)
    grads = DataParallelGrads(model, Mesh.single(device), zero=zero, bucket_mb=0.02)
    kw = dict(lr=3e-3, betas=(0.9, 0.95))
    if kind == "lamb":
        opt_ref = build_lamb(ref, 0.1, eps=1e-6, **kw)
        opt = build_lamb(model, 0.1, eps=1e-6, **kw) if zero == 0 else ShardedOptimizer(
            grads, "lamb", weight_decay=0.1, eps=1e-6, **kw)
    else:
        opt_ref = torch.optim.AdamW(param_groups(ref, 0.1), eps=1e-8, fused=True, **kw)
        opt = torch.optim.AdamW(param_groups(model, 0.1), eps=1e-8, fused=True, **kw) if zero == 0 else \
            ShardedOptimizer(grads, "adamw", weight_decay=0.1, eps=1e-8, **kw)
    gen = torch.Generator().manual_seed(5)
    for _ in range(3):
        batch = torch.randint(0, VOCAB, (4, SEQ + 1), generator=gen).to(device)
        loss_ref = ref(batch[:, :-1], batch[:, 1:])
        loss_ref.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        total = torch.zeros((), device=device)
        for i in range(2):
            if i == 1:
                grads.start_last_microbatch()
            chunk = batch[2 * i:2 * i + 2]
            loss = model(chunk[:, :-1], chunk[:, 1:]) / 2
            loss.backward()
            total += loss.detach()
        grads.finish()
        if zero == 2:
            assert grads.memory()["main_grads"] == 0
        grads.clip(0.5)
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad(set_to_none=True)
        opt.zero_grad(set_to_none=True)
        assert abs(total.item() - loss_ref.item()) <= 1e-5 * loss_ref.item()
    model.state_dict()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert (p - q).abs().max().item() < 1e-4


@pytest.mark.parametrize("kind", ["adamw", "lamb"])
def test_zero1_step_has_no_host_sync_after_warm_up(kind: str) -> None:
    """A ZeRO-1 step (bucketed gradients, sharded norm and clipping, the sharded fused AdamW or LAMB, parameter
    gathers) queues its work without waiting for the device once warmed up: torch's sync debug mode turns any
    synchronising call (a tensor made from a host list, .item(), a pageable copy) into an error. The NaN guard's
    one read per step is off here (it is the step's single, intended sync)."""
    from megaloom.step import TrainStep

    device = torch.device("cuda")
    torch.manual_seed(0)
    model = Transformer(tiny_config().model).to(device)
    grads = DataParallelGrads(model, Mesh.single(device), zero=1, bucket_mb=0.02)
    opt = ShardedOptimizer(grads, kind, lr=3e-3, weight_decay=0.1)
    step = TrainStep(model, opt, "fp32", device, 2, grad_clip=0.5, grads=grads, nan_guard=False)
    gen = torch.Generator().manual_seed(5)
    batches = [torch.randint(0, VOCAB, (4, SEQ + 1), generator=gen).to(device) for _ in range(4)]
    for b in batches[:2]:  # warm-up: lazy state, the constants made on the device once
        step(b)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for b in batches[2:]:
            out = step(b)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.isfinite(out.loss).item() and torch.isfinite(out.grad_norm).item()
