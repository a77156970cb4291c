"""Activation offload (train.offload_activations) and full recomputation of only the first N blocks
(train.recompute_layers): same gradients as the plain run, the right tensors moved, the plan's memory falls."""

import torch

from megaloom.config import load_config
from megaloom.models import Transformer, apply_recompute
from megaloom.planning.memory_plan import plan_memory
from megaloom.precision import offload
from megaloom.step import forward_ctx


def tiny(n_layers=3):
    cfg = load_config(None, ["model.vocab_size=128", "model.d_model=64", f"model.n_layers={n_layers}",
                             "model.n_heads=4", "model.n_kv_heads=2", "train.seq_len=32", "model.max_seq_len=64"])
    torch.manual_seed(0)
    return Transformer(cfg.model)


def grads(model, batch, precision="fp32", offload_on=False):
    model.zero_grad(set_to_none=True)
    with forward_ctx(precision, torch.device("cpu"), offload_on):
        loss = model(batch[:, :-1], batch[:, 1:])
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_offloaded_activations_give_identical_gradients_and_parameters_stay(monkeypatch):
    monkeypatch.setattr(offload, "OFFLOAD_FROM", {"cpu"})  # exercise the hooks on CPU tensors
    monkeypatch.setattr(offload, "MIN_BYTES", 1024)
    packed, kept = [], []
    real_pack = offload._pack

    def counting_pack(t):
        out = real_pack(t)
        (kept if out is t else packed).append(t)
        return out

    monkeypatch.setattr(offload, "_pack", counting_pack)
    model = tiny()
    batch = torch.randint(0, 128, (4, 33), generator=torch.Generator().manual_seed(1))
    loss_ref, ref = grads(model, batch)
    loss, got = grads(model, batch, offload_on=True)
    assert torch.equal(loss, loss_ref)
    for n in ref:
        assert torch.equal(got[n], ref[n]), n
    assert len(packed) > 10  # activations went to host memory ...
    params = {id(p) for p in model.parameters()}
    assert not any(id(t) in params for t in packed)  # ... parameters did not
    # Under autocast the cached bf16 copies of the weights stay too (autocast keeps them anyway).
    packed.clear()
    grads(model, batch, precision="bf16", offload_on=True)
    assert packed and not any(t.grad_fn is not None and type(t.grad_fn).__name__ == "ToCopyBackward0"
                              and type(t.grad_fn.next_functions[0][0]).__name__ == "AccumulateGrad"
                              for t in packed)


def test_recompute_first_n_layers_gives_identical_gradients():
    model = tiny(n_layers=3)
    batch = torch.randint(0, 128, (2, 33), generator=torch.Generator().manual_seed(2))
    loss_ref, ref = grads(model, batch)
    apply_recompute(model, "full", 1)
    assert model.recompute_layers == 1
    loss, got = grads(model, batch)
    assert torch.equal(loss, loss_ref)
    for n in ref:
        assert torch.equal(got[n], ref[n]), n


def _plan(*extra):
    cfg = load_config(None, ["model.preset=llama3-1b-untied", "train.seq_len=4096", "train.micro_batch_size=2",
                             "train.global_batch_size=2", "train.precision=bf16", *extra])
    return plan_memory(cfg, device="cuda")


def test_plan_partial_recompute_and_offload_lie_between():
    none, full = _plan(), _plan("train.recompute=full")
    half = _plan("train.recompute=full", "train.recompute_layers=8")
    assert full.activations < half.activations < none.activations
    off = _plan("train.offload_activations=true")
    assert off.activations < half.activations and off.peak < none.peak
