"""What the ranks of the expert-parallel world run (see test_expert_world.py): numbers, not assertions."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from megaloom.models.moe import LocalDispatcher, MoE
from megaloom.parallel import comm
from megaloom.parallel.expert import AllToAllDispatcher, parallelize_moe
from megaloom.parallel.layout import layout_of
from megaloom.parallel.mesh import Mesh
from megaloom.parallel.tensor import gather_full_tensor

from .worlds import tiny_config

D, E, K, F, T = 16, 8, 2, 32, 24  # model width, experts, top-k, expert width, tokens per rank


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def _mesh(world: int, rank: int, device: torch.device, tp: int, ep: int) -> Mesh:
    cfg = tiny_config(tp=tp, ep=ep, world=world)
    cfg.model.moe_every, cfg.model.n_experts = 1, E
    return Mesh.build(cfg, world, rank, device)


def identity_case(mesh: Mesh, capacity: int | None) -> dict:
    """All-to-all dispatch, identity experts, combine: equals the local dispatch/combine on the same tokens
    (which is x itself when nothing is dropped and the weights sum to 1), forward and backward."""
    gen = torch.Generator().manual_seed(100 + mesh.rank)
    x = torch.randn(T, D, generator=gen).to(mesh.device).requires_grad_()
    logits = torch.randn(T, E, generator=gen).to(mesh.device)
    experts = logits.topk(K, dim=-1).indices
    weights = torch.rand(T, K, generator=gen).to(mesh.device)
    weights = weights / weights.sum(-1, keepdim=True)
    d = AllToAllDispatcher(mesh).dispatch(x, weights, experts, E, capacity)
    got = AllToAllDispatcher(mesh).combine(d.x, d)
    got.backward(torch.ones_like(got))
    x_ref = x.detach().clone().requires_grad_()
    local = LocalDispatcher()
    dl = local.dispatch(x_ref, weights, experts, E, capacity)
    want = local.combine(dl.x, dl)
    want.backward(torch.ones_like(want))
    return dict(err=_err(got, want), err_x=_err(got, x) if capacity is None else None,
                grad_err=_err(x.grad, x_ref.grad), rows=d.x.shape[0], local_counts=d.counts.tolist(),
                dropped=int(d.dropped))


def layer_case(mesh: Mesh, sp: bool, capacity_factor: float) -> dict:
    """One MoE layer split over ep (and tp) against the full layer run on each rank's tokens in turn."""
    torch.manual_seed(7)
    ref = MoE(D, E, K, F, n_shared_experts=1, aux_loss_weight=0.01, z_loss_weight=1e-3,
              capacity_factor=capacity_factor).to(mesh.device)
    model = parallelize_moe(copy.deepcopy(ref), mesh, sp)
    n_dp = mesh.dp
    gen = torch.Generator().manual_seed(5)
    xs = [torch.randn(2, T // 2, D, generator=gen).to(mesh.device) for _ in range(n_dp)]
    cs = [torch.randn(2, T // 2, D, generator=gen).to(mesh.device) for _ in range(n_dp)]
    # reference: every data-parallel rank's tokens through the full layer, gradients summed
    ref_out = []
    for x, c in zip(xs, cs, strict=True):
        y = ref(x)
        (y * c).sum().backward()
        ref_out.append(y.detach())
    x, c = xs[mesh.dp_rank], cs[mesh.dp_rank]
    if sp:  # this tp rank holds its slice of the sequence
        n = x.shape[1] // mesh.tp
        x, c = x[:, mesh.tp_rank * n:(mesh.tp_rank + 1) * n], c[:, mesh.tp_rank * n:(mesh.tp_rank + 1) * n]
    x = x.clone().requires_grad_()
    mesh.recorder = tally = comm.CommTally(mesh.group_names())  # the layer's collectives, forward and backward
    y = model(x)
    (y * c).sum().backward()
    mesh.recorder = comm.NullRecorder()
    want = ref_out[mesh.dp_rank]
    if sp:
        want = want[:, mesh.tp_rank * n:(mesh.tp_rank + 1) * n]
    names = mesh.group_names()
    ep_name, tp_name = names.get(mesh.ep_group), names.get(mesh.tp_group)
    out = dict(out_err=_err(y, want), dropped=float(model.last_dropped_fraction),
               ep_bytes={op: n for (g, op), n in tally.bytes.items() if g == ep_name},
               tp_bytes={op: n for (g, op), n in tally.bytes.items() if g == tp_name})
    grads, ref_grads = {}, dict(ref.named_parameters())
    for name, p in model.named_parameters():
        g = p.grad.detach().clone()
        # The full model's gradient sums every dp rank's tokens: experts are summed over edp (their ep peers'
        # tokens arrived through the all-to-all), replicated weights over all of dp.
        group = mesh.edp_group if layout_of(p).expert else mesh.dp_group
        comm.all_reduce(g, group)
        if layout_of(p).tp_partial:
            comm.all_reduce(g, mesh.tp_group)
        full = gather_full_tensor(g, p, mesh)
        grads[name] = (_err(full, ref_grads[name].grad), ref_grads[name].grad.abs().max().item(),
                       tuple(p.shape), tuple(full.shape))
    out["grads"] = grads
    return out


def suite_expert_world4(rank: int, world: int, device: torch.device) -> dict:
    res: dict = {}
    for ep in (2, 4):
        mesh = _mesh(world, rank, device, tp=1, ep=ep)
        res[f"identity-ep{ep}"] = identity_case(mesh, None)
        res[f"identity-ep{ep}-cap"] = identity_case(mesh, 4)
        res[f"layer-ep{ep}"] = layer_case(mesh, sp=False, capacity_factor=0.0)
        res[f"layer-ep{ep}-cap"] = layer_case(mesh, sp=False, capacity_factor=1.0)
    for sp in (False, True):
        mesh = _mesh(world, rank, device, tp=2, ep=2)
        res[f"layer-tp2-ep2-sp{int(sp)}"] = layer_case(mesh, sp=sp, capacity_factor=1.0)
    mesh = _mesh(world, rank, device, tp=2, ep=1)
    res["layer-tp2-ep1-sp1"] = layer_case(mesh, sp=True, capacity_factor=0.0)
    dist.barrier()
    return res


def suite_expert_trainer_world4(rank: int, world: int, device: torch.device, runs: dict[str, list[str]]) -> dict:
    """`Trainer` at each MoE layout of ``runs`` (name -> the run's full overrides, run.dir included), one after
    the other in this world of 4: the test compares their metrics and checkpoints with the single process."""
    from megaloom.config import load_config
    from megaloom.runtime import Runtime
    from megaloom.training.trainer import Trainer

    for overrides in runs.values():
        Trainer(load_config(None, overrides),
                runtime=Runtime(device=device, rank=rank, world_size=world, local_rank=rank)).build().fit()
        dist.barrier()
    return {}
