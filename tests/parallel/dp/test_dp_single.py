"""The data-parallel machinery in one process (no peers: every collective is the identity): bucket planning,
main-gradient accumulation, the sharded optimizer against plain AdamW, checkpoint state, errors."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from megaloom.config import ConfigError
from megaloom.models import Transformer
from megaloom.optim.param_groups import param_groups
from megaloom.optim.zero import ShardedOptimizer, build_data_parallel
from megaloom.parallel.data_parallel import DataParallelGrads, plan_buckets
from megaloom.parallel.mesh import Mesh

from ..full_state import full_optimizer_state, load_full_optimizer_state
from ..worlds import SEQ, VOCAB, tiny_config


def test_plan_buckets_reverse_order_threshold_and_padding() -> None:
    plan = plan_buckets([5, 3, 8, 2, 7], bucket_numel=9, world=4)
    assert [idx for idx, _, _ in plan] == [[4, 3], [2, 1], [0]]  # last parameter first, never split
    assert [offs for _, offs, _ in plan] == [[0, 7], [0, 8], [0]]
    assert [padded for _, _, padded in plan] == [12, 12, 8]  # 9, 11, 5 rounded up to multiples of 4
    assert plan_buckets([4, 4], bucket_numel=1, world=1) == [([1], [0], 4), ([0], [0], 4)]
    assert plan_buckets([], 10, 2) == []


def _setup(zero: int, bucket_mb: float = 0.02):
    torch.manual_seed(0)
    ref = Transformer(tiny_config().model)
    model = copy.deepcopy(ref)
    grads = DataParallelGrads(model, Mesh.single(), zero=zero, bucket_mb=bucket_mb)
    return ref, model, grads


def _batches(n: int = 3) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(0, VOCAB, (4, SEQ + 1), generator=gen) for _ in range(n)]


@pytest.mark.parametrize("zero", [0, 1, 2])
def test_one_process_matches_plain_adamw(zero: int) -> None:
    ref, model, grads = _setup(zero)
    assert len(grads.buckets) > 2
    kw = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8)
    opt_ref = torch.optim.AdamW(param_groups(ref, 0.1), **kw, foreach=True)
    opt = (torch.optim.AdamW(param_groups(model, 0.1), **kw, foreach=True) if zero == 0
           else ShardedOptimizer(grads, "adamw", weight_decay=0.1, **kw))
    for batch in _batches():
        ref(batch[:, :-1], batch[:, 1:]).backward()
        norm_ref = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        for i in range(2):  # two micro-batches of two rows
            if i == 1:
                grads.start_last_microbatch()
            chunk = batch[2 * i:2 * i + 2]
            (model(chunk[:, :-1], chunk[:, 1:]) / 2).backward()
            assert all(p.grad is None for p in model.parameters())  # moved into main_grad by the hook
        grads.finish()
        norm = grads.clip(0.5)
        torch.testing.assert_close(norm, norm_ref, rtol=1e-5, atol=0)
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad(set_to_none=True)
        opt.zero_grad(set_to_none=True)
        if zero:  # the parameter all-gathers are issued, not waited for: the next forward's hooks wait
            assert grads.params_in_flight()
            with torch.no_grad():
                model(batch[:1, :-1])
            assert not grads.params_in_flight()
    model.state_dict()  # waits for the (here trivial) parameter gathers
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert (p - q).abs().max().item() < 1e-4, name  # Adam magnifies float noise of tiny gradients
    assert list(grads.stats.per_step) == [[1] * len(grads.buckets)] * 3
    assert list(grads.stats.in_backward) == [len(grads.buckets)] * 3


def test_sharded_adamw_steps_in_bounded_groups_with_the_same_values(monkeypatch) -> None:
    """The foreach AdamW (CPU) allocates sqrt(exp_avg_sq) for a whole parameter group: the shard is stepped in
    groups of about STEP_GROUP_ELEMENTS (plus one segment), which leaves every value bit-identical."""
    import megaloom.optim.zero as zero_mod

    assert zero_mod.step_groups([0, 1, 2, 3, 4], [5, 3, 8, 2, 7], limit=8) == [[0, 1], [2], [3, 4]]
    runs = []
    for limit in (1 << 40, 3000):
        monkeypatch.setattr(zero_mod, "STEP_GROUP_ELEMENTS", limit)
        _, model, grads = _setup(1)
        opt = ShardedOptimizer(grads, "adamw", lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
        sizes = [sum(t.numel() for t in g["params"]) for g in opt.param_groups]
        assert max(sizes) < limit + max(t.numel() for t in opt.tensors)
        for batch in _batches(2):
            grads.start_last_microbatch()
            model(batch[:, :-1], batch[:, 1:]).backward()
            grads.finish()
            opt.step()
            opt.zero_grad(set_to_none=True)
        model.state_dict()  # waits for the parameter gathers
        runs.append((len(sizes), [p.detach().clone() for p in model.parameters()]))
    assert runs[0][0] == 2 and runs[1][0] > 4, [n for n, _ in runs]  # decay / no decay, then many groups
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1], strict=True))


def test_main_grad_accumulates_micro_batches_and_zeroes_next_step() -> None:
    ref, model, grads = _setup(0)
    batch = _batches(1)[0]
    ref(batch[:, :-1], batch[:, 1:]).backward()
    for i in range(2):
        chunk = batch[2 * i:2 * i + 2]
        (model(chunk[:, :-1], chunk[:, 1:]) / 2).backward()
    grads.finish()  # never armed: everything is issued here, none in backward
    assert list(grads.stats.in_finish) == [len(grads.buckets)] and list(grads.stats.in_backward) == [0]
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert p.grad is p.main_grad
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)
    # Forgetting zero_grad: the next backward would add into p.grad, which is the main gradient itself.
    with pytest.raises(RuntimeError, match="zero_grad"):
        model(batch[:2, :-1], batch[:2, 1:]).backward()


def test_zero2_releases_full_buckets_between_steps() -> None:
    _, model, grads = _setup(2)
    opt = ShardedOptimizer(grads, "lamb", lr=1e-3, weight_decay=0.1)
    batch = _batches(1)[0]
    grads.start_last_microbatch()
    model(batch[:, :-1], batch[:, 1:]).backward()
    assert grads.memory()["main_grads"] > 0
    grads.finish()
    assert grads.memory()["main_grads"] == 0 and all(p.main_grad is None for p in model.parameters())
    opt.step()
    grads.start_last_microbatch()  # a second step allocates them again
    model(batch[:, :-1], batch[:, 1:]).backward()
    grads.finish()
    assert list(grads.stats.per_step) == [[1] * len(grads.buckets)] * 2


def test_full_state_round_trip_in_one_process() -> None:
    _, model, grads = _setup(1)
    opt = ShardedOptimizer(grads, "adamw", lr=1e-3)
    batch = _batches(1)[0]
    grads.start_last_microbatch()
    model(batch[:, :-1], batch[:, 1:]).backward()
    grads.finish()
    opt.step()
    state = full_optimizer_state(opt)
    names = [n for n, _ in model.named_parameters()]
    assert sorted(state["state"]) == sorted(names)
    for name, p in model.named_parameters():
        st = state["state"][name]
        assert st["exp_avg"].shape == p.shape and float(st["step"]) == 1.0
    _, model2, grads2 = _setup(1)
    opt2 = ShardedOptimizer(grads2, "adamw", lr=1e-3)
    load_full_optimizer_state(opt2, state)
    again = full_optimizer_state(opt2)["state"]
    for name in names:
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(again[name][k], state["state"][name][k]), (name, k)


def test_user_errors_name_the_setting() -> None:
    torch.manual_seed(0)
    model = Transformer(tiny_config().model)
    with pytest.raises(ConfigError, match=r"parallel\.bucket_mb=0"):
        DataParallelGrads(model, Mesh.single(), bucket_mb=0)
    with pytest.raises(ConfigError, match=r"parallel\.zero=5"):
        build_data_parallel(model, Mesh.single(), zero=5)
    with pytest.raises(ConfigError, match=r"parallel\.zero=3 .*parallel\.zero=0"):
        build_data_parallel(model, Mesh.single(), zero=3)
    grads = DataParallelGrads(model, Mesh.single(), zero=1)
    with pytest.raises(ConfigError, match=r"train\.optimizer='sgd'.*adamw"):
        ShardedOptimizer(grads, "sgd")


def test_no_sync_only_accumulates() -> None:
    _, model, grads = _setup(0)
    batch = _batches(1)[0]
    grads.start_last_microbatch()
    with grads.no_sync():
        model(batch[:, :-1], batch[:, 1:]).backward()
    assert list(grads.stats.in_backward) == [0] and grads.stats.unarmed_hooks == len(grads.params)
    grads.finish()
    assert list(grads.stats.in_finish) == [len(grads.buckets)]
    assert math.isfinite(grads.clip(math.inf).item())


def _zero1_step(kind: str):
    """A ZeRO-1 TrainStep on one process (the step path a GPU run takes, without its peers) and its batches."""
    from megaloom.step import TrainStep

    _, model, grads = _setup(1)
    opt = ShardedOptimizer(grads, kind, lr=3e-3, weight_decay=0.1)
    return TrainStep(model, opt, "fp32", torch.device("cpu"), 2, grad_clip=0.5, grads=grads), grads, opt


@pytest.mark.parametrize("kind", ["adamw", "lamb"])
def test_zero1_step_makes_no_tensor_from_host_lists_after_the_first(kind: str, monkeypatch) -> None:
    """The constants a step needs (the norm's per-shard weights, LAMB's owner index and weights) are made on the
    device once and reused: on a GPU a tensor made from a Python list is a host-to-device copy that waits for the
    host every step. Counted here by patching torch.tensor: no call from megaloom's code after the first step."""
    import sys

    from megaloom.optim.lamb import tp_norm_sync

    step, grads, opt = _zero1_step(kind)
    batches = _batches(4)
    step(batches[0])  # the first step makes them
    assert grads.constants.made == 1 and (kind == "adamw" or opt.inner.norm_sync.constants.made == 2)
    calls: list[str] = []
    real = torch.tensor

    def counting(*a, **k):
        where = sys._getframe(1).f_code.co_filename
        if "megaloom" in where:
            calls.append(where)
        return real(*a, **k)

    monkeypatch.setattr(torch, "tensor", counting)
    for b in batches[1:]:
        step(b)
    assert calls == [], calls
    assert grads.constants.made == 1 and (kind == "adamw" or opt.inner.norm_sync.constants.made == 2)
    # LAMB's tensor-parallel norm exchange, on a mesh with tp=2 and no peers (its collectives are the identity):
    # its weights are made at the first call only
    params = list(step.model.parameters())
    sync = tp_norm_sync(params, Mesh(tp=2))
    for _ in range(3):
        sync(torch.ones(len(params), 2))
    assert len(calls) == 1 and calls[0].endswith("lamb.py") and sync.constants.made == 1, calls
