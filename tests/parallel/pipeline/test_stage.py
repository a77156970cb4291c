"""Pipeline stages, the split backward and the executor on one process (pp = 1, chunks passing data locally)."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from megaloom.config import load_config
from megaloom.data.objective import inputs_and_labels
from megaloom.models import Transformer, apply_recompute
from megaloom.parallel.layout import layout_of
from megaloom.parallel.mesh import Mesh
from megaloom.parallel.pipeline.executor import PipelineExecutor
from megaloom.parallel.pipeline.partition import partition_layers
from megaloom.parallel.pipeline.schedules import build_schedule, forward_only
from megaloom.parallel.pipeline.split_backward import backward_input
from megaloom.parallel.pipeline.stage import PipelineStage, checkpoint_name
from megaloom.step import micro_batches

SEQ, VOCAB = 16, 128


def _model(arch: str = "llama", n_layers: int = 4, tie: bool = True) -> Transformer:
    cfg = load_config(None, [f"model.arch={arch}", f"model.vocab_size={VOCAB}", "model.d_model=64",
                             f"model.n_layers={n_layers}", "model.n_heads=4", "model.n_kv_heads=2",
                             "model.ffn_dim=128", f"model.max_seq_len={SEQ}", f"model.tie_embeddings={tie}",
                             f"train.seq_len={SEQ}"])
    torch.manual_seed(0)
    return Transformer(cfg.model)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_stages_keep_single_model_names_and_compose(arch: str) -> None:
    full = _model(arch, n_layers=8)
    part = partition_layers(8, pp=2, vpp=2)
    stages = [PipelineStage(copy.deepcopy(full), part, r) for r in range(2)]
    names = [dict(s.model.named_parameters()) for s in stages]
    assert sorted(n.split(".")[1] for n in names[0] if n.startswith("layers.") and n.endswith("attn_norm.weight")) \
        == ["0", "1", "4", "5"]  # chunks 0 and 2 of the ring
    single = dict(full.named_parameters())
    assert set(names[0]) | set(names[1]) == set(single) | {"head.weight"}
    for rank_names in names:
        for n, p in rank_names.items():
            assert torch.equal(p, single.get(n, single["tok_emb.weight"]))
    head = stages[1].model.head.weight
    assert head is not stages[0].model.tok_emb.weight and layout_of(head).tied_copy  # tied: an equal, separate copy
    assert checkpoint_name("head.weight", head) == "tok_emb.weight"  # its optimizer state's single-model name
    assert checkpoint_name("norm.weight", stages[1].model.norm.weight) == "norm.weight"
    assert "head.weight" in stages[1].model.state_dict() and "rope_cos" not in stages[1].model.state_dict()

    x = torch.randint(0, VOCAB, (2, SEQ + 1))
    h = x[:, :-1]
    for s in range(4):  # stage s is chunk s // 2 of rank s % 2
        h = stages[s % 2](h, s // 2, x[:, 1:] if s == 3 else None, seq_len=SEQ)
    assert torch.allclose(h, full(x[:, :-1], x[:, 1:]), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_split_backward_is_the_full_backward(recompute: str) -> None:
    full = _model()
    apply_recompute(full, recompute)
    stage = PipelineStage(full, partition_layers(4, 2), 1)  # the last stage: layers 2, 3, norm, head, loss
    x, y = torch.randn(2, SEQ, 64), torch.randint(0, VOCAB, (2, SEQ))
    xa = x.clone().requires_grad_()
    stage(xa, 0, y, SEQ).backward()
    ref = {n: p.grad.clone() for n, p in stage.model.named_parameters()}
    stage.model.zero_grad(set_to_none=True)

    fired: list[int] = []  # gradient buckets (data parallelism) hook weights' accumulation: BW must trigger it
    stage.model.norm.weight.register_post_accumulate_grad_hook(lambda p: fired.append(1))
    xb = x.clone().requires_grad_()
    out = stage(xb, 0, y, SEQ)
    # FlopCounterMode hooks the modules that recomputation re-runs inside autograd.grad: count without it only.
    count = recompute == "none"
    with FlopCounterMode(display=False) if count else contextlib.nullcontext() as bi_flops:
        dx, pending = backward_input(out, None, xb, stage.chunk_parameters(0))
    # Same arithmetic; only the order in which autograd sums the residual branches may differ (last bit).
    assert torch.allclose(dx, xa.grad, rtol=1e-6, atol=1e-9)
    assert all(p.grad is None for p in stage.parameters())  # BI computed no weight gradient
    with FlopCounterMode(display=False) if count else contextlib.nullcontext() as bw_flops:
        pending.run()
    for n, p in stage.model.named_parameters():
        assert torch.allclose(p.grad, ref[n], rtol=1e-6, atol=1e-9), n
    assert fired == [1]
    if count:  # the weight matmuls are half of the backward and all of BW
        assert bw_flops.get_total_flops() == bi_flops.get_total_flops() > 0


def _reference_step(model: Transformer, batch: torch.Tensor, micro: int) -> float:
    n = batch.shape[0] // micro
    total = 0.0
    for x, y in micro_batches(batch, micro):
        loss = model(x, y) / n
        loss.backward()
        total += loss.item()
    return total


@pytest.mark.parametrize("schedule,vpp", [("interleaved", 2), ("zb", 1), ("gpipe", 1)])
def test_executor_on_one_process(schedule: str, vpp: int) -> None:
    """pp = 1: the chunks of one rank hand activations and gradients to each other without messages."""
    ref = _model()
    stage = PipelineStage(copy.deepcopy(ref), partition_layers(4, 1, vpp), 0)
    mesh = Mesh.single()
    ex = PipelineExecutor(stage, build_schedule(schedule, 1, vpp, 3), mesh, micro_batch_size=2, seq_len=SEQ,
                          timing=True, inputs_and_labels=inputs_and_labels)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=3e-3)
    opt = torch.optim.AdamW(stage.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        batch = torch.randint(0, VOCAB, (6, SEQ + 1), generator=gen)
        loss_ref = _reference_step(ref, batch, 2)
        armed: list[tuple[int, list]] = []
        loss = ex.run(batch, before_last_backward=lambda params, armed=armed: armed.append((len(ex.events), params))
                      ).item()
        # called once per chunk with its parameters, just before the last computation writing its weight gradients
        assert sorted(map(id, (p for _, p in armed))) == sorted(map(id, ex.params)) and len(armed) == vpp
        for at, params in armed:
            chunk = next(c for c in range(vpp) if ex.params[c] is params)
            later = [e for e in ex.events[at:] if e.kind != "COMM"]
            # (zb on one stage: the first stage's BI is the full backward and its BW are empty)
            assert later[0].kind == ("BI" if schedule == "zb" else "B") and later[0].stage == chunk  # pp = 1
            assert all(e.kind == "BW" or e.stage != chunk for e in later[1:])
        assert loss == pytest.approx(loss_ref, rel=1e-6)
        grads_ref = {n: p.grad for n, p in ref.named_parameters()}
        for n, p in stage.model.named_parameters():
            assert torch.allclose(p.grad, grads_ref[n], rtol=1e-5, atol=1e-7), n
        for opt_ in (opt_ref, opt):
            opt_.step()
            opt_.zero_grad(set_to_none=True)
    kinds = [e.kind for e in ex.events]
    assert "COMM" not in kinds and kinds.count("F") == 3 * vpp
    batch = torch.randint(0, VOCAB, (6, SEQ + 1), generator=gen)
    ev = PipelineExecutor(stage, forward_only(1, vpp, 3), mesh, 2, SEQ,
                          inputs_and_labels=inputs_and_labels).run(batch)
    with torch.no_grad():
        assert ev.item() == pytest.approx(sum(ref(x, y) for x, y in micro_batches(batch, 2)).item() / 3, rel=1e-6)


def test_executor_refuses_a_wrong_batch() -> None:
    stage = PipelineStage(_model(), partition_layers(4, 1), 0)
    ex = PipelineExecutor(stage, build_schedule("1f1b", 1, 1, 2), Mesh.single(), 2, SEQ,
                          inputs_and_labels=inputs_and_labels)
    with pytest.raises(ValueError, match="needs a batch of 2 x 2 rows"):
        ex.run(torch.zeros(3, SEQ + 1, dtype=torch.long))
