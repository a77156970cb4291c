"""Gather-everything references for the tests: a model's and an optimizer's state as full tensors under parameter
names, whatever the layout, and the way back (each rank keeps its piece).

megaloom itself never gathers a whole model: checkpoints are written piece by piece by the ranks that own each
piece (megaloom/checkpoint/sharded.py). These functions give the tests one layout-free picture to compare layouts
with: collective over tp, dp and ep where the state is split over them, and reaching into ShardedOptimizer's and
FullyShardedGrads' internals (segments, FSDP2 shards) as only a test should.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from megaloom.optim.zero import FullyShardedGrads, ShardedOptimizer, _dim0_start, _local
from megaloom.parallel import comm
from megaloom.parallel.expert import is_expert_param
from megaloom.parallel.layout import single_model_name
from megaloom.parallel.mesh import Mesh
from megaloom.parallel.state import shard_of
from megaloom.parallel.tensor import gather_full_tensor


def full_model_state(model: nn.Module, mesh: Mesh) -> dict[str, torch.Tensor]:
    """Every parameter and buffer full-size under its name: FSDP2 (ZeRO-3) shards gathered over dp (`full_tensor`),
    tensor-parallel and expert shards over tp and ep."""
    params = dict(model.named_parameters(remove_duplicate=False))
    out = {}
    for k, v in model.state_dict().items():
        full = v.full_tensor() if hasattr(v, "full_tensor") else v
        out[k] = gather_full_tensor(full, params[k], mesh, sum_replicas=False) if k in params else full.detach().clone()
    return out


def full_optim_state(model: nn.Module, optimizer: torch.optim.Optimizer, mesh: Mesh) -> dict:
    """{'state': {name: {key: full tensor}}} of a plain (per-parameter) optimizer, or of a ZeRO one."""
    if isinstance(optimizer, ShardedOptimizer):
        return full_optimizer_state(optimizer)
    names = {id(p): single_model_name(n, p) for n, p in model.named_parameters()}
    state: dict[str, dict] = {}
    for p, st in optimizer.state.items():
        state[names[id(p)]] = {k: (gather_full_tensor(v, p, mesh, sum_replicas=False)
                                   if torch.is_tensor(v) and v.shape == p.shape and v.ndim > 0 else v)
                               for k, v in st.items()}
    return {"state": state}


def load_full_state(model: nn.Module, optimizer: torch.optim.Optimizer | None, model_sd: dict,
                    optim_sd: dict | None, mesh: Mesh) -> None:
    """This rank's pieces of full tensors into the model (and a plain or ZeRO optimizer)."""
    if isinstance(optimizer, ShardedOptimizer):
        load_full_model_state(optimizer, model_sd)
        if optim_sd is not None:
            load_full_optimizer_state(optimizer, optim_sd)
        return
    _copy_pieces(model, model_sd, mesh)
    if optimizer is None or optim_sd is None:
        return
    by_name = {single_model_name(n, p): p for n, p in model.named_parameters()}
    for name, st in optim_sd["state"].items():
        p = by_name[name]
        target = optimizer.state.setdefault(p, {})
        for k, v in st.items():
            local = shard_of(v, p, mesh) if torch.is_tensor(v) and v.ndim > 0 else v
            if k in target and torch.is_tensor(target[k]):
                target[k].copy_(local)
            else:
                target[k] = local.clone() if torch.is_tensor(local) else local


def _copy_pieces(model: nn.Module, model_sd: dict, mesh: Mesh) -> None:
    params = dict(model.named_parameters(remove_duplicate=False))
    with torch.no_grad():
        for k, t in model.state_dict().items():
            src = model_sd[k]
            t.copy_(shard_of(src, params[k], mesh) if k in params else src)


# ------------------------------------------------------------------------------------------ ZeRO optimizers


def _gathered(opt: ShardedOptimizer, key: str) -> list[torch.Tensor]:
    """State ``key`` of every parameter at its tp-local full size: each rank writes its segments into a zero
    buffer of the whole (tp-local) model and all-reduces assemble it (the pieces are disjoint)."""
    mesh = opt.mesh
    numels = [math.prod(p.shape) for _, p in opt.named_params]
    offsets = [0]
    for n in numels:
        offsets.append(offsets[-1] + n)
    flat = torch.zeros(offsets[-1], dtype=torch.float32, device=mesh.device)
    for t, s in zip(opt.tensors, opt.segments, strict=True):
        v = opt.inner.state[t][key].reshape(-1)
        a = offsets[s.owner] + s.start
        flat[a:a + v.numel()] = v
    if mesh.ep > 1 and any(is_expert_param(p) for _, p in opt.named_params):
        # expert pieces are spread over edp only: sum over edp, then the dense pieces alone over ep
        comm.all_reduce(flat, mesh.edp_group, recorder=mesh.recorder)
        dense = torch.ones_like(flat, dtype=torch.bool)
        for i, (_, p) in enumerate(opt.named_params):
            if is_expert_param(p):
                dense[offsets[i]:offsets[i + 1]] = False
        rest = comm.all_reduce(flat * dense, mesh.ep_group, recorder=mesh.recorder)
        flat = torch.where(dense, rest, flat)
    else:
        comm.all_reduce(flat, opt.layout.group, recorder=mesh.recorder)
    return [flat[offsets[i]:offsets[i + 1]].view(tuple(p.shape)) for i, (_, p) in enumerate(opt.named_params)]


def _step_count(opt: ShardedOptimizer) -> torch.Tensor:
    count = torch.zeros((), dtype=torch.float32)
    for st in opt.inner.state.values():
        count = st["step"].detach().float().cpu().clone()
        break
    return comm.all_reduce(count.to(opt.mesh.device), opt.layout.group, op="max", recorder=opt.mesh.recorder).cpu()


def full_optimizer_state(opt: ShardedOptimizer) -> dict:
    """{'state': {name: {'step', 'exp_avg', 'exp_avg_sq'}}} at full size, as `full_optim_state` gives for AdamW."""
    step = _step_count(opt)
    gathered = {k: _gathered(opt, k) for k in ("exp_avg", "exp_avg_sq")}
    return {"state": {name: {"step": step.clone(), **{k: gather_full_tensor(v[i], p, opt.mesh)
                                                      for k, v in gathered.items()}}
                      for i, (name, p) in enumerate(opt.named_params)}}


def sharded_model_state(opt: ShardedOptimizer) -> dict[str, torch.Tensor]:
    """The model of a ZeRO optimizer at full size, whatever the stage."""
    if isinstance(opt.layout, FullyShardedGrads):
        return fsdp_model_state(opt.layout)
    return full_model_state(opt.layout.model, opt.mesh)  # its state_dict pre-hook waits for the gathers


def load_full_model_state(opt: ShardedOptimizer, model_sd: dict[str, torch.Tensor]) -> None:
    if isinstance(opt.layout, FullyShardedGrads):
        load_fsdp_model_state(opt.layout, model_sd)
    else:  # parameters are views of the bucket buffers, so the copy lands there (master weights included)
        opt.layout.wait_params()
        _copy_pieces(opt.layout.model, model_sd, opt.mesh)
        opt.weights_loaded(masters_loaded=False)


def load_full_optimizer_state(opt: ShardedOptimizer, optim_sd: dict) -> None:
    """This rank's pieces of full tensors (its tp slice, then its segments of the flat shard)."""
    entries = optim_sd["state"]
    for t, s in zip(opt.tensors, opt.segments, strict=True):
        name, p = opt.named_params[s.owner]
        st = opt.inner.state[t]
        for k, v in entries[name].items():
            if k == "step":
                st["step"].copy_(torch.as_tensor(v, dtype=torch.float32))
                continue
            local = shard_of(v, p, opt.mesh).reshape(-1)
            st[k].copy_(local[s.start:s.start + t.numel()].view_as(st[k]))


# ------------------------------------------------------------------------------------------ ZeRO-3 (FSDP2)


def fsdp_model_state(grads: FullyShardedGrads) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of an FSDP2 model at full size under its usual name."""
    params = dict(grads.model.named_parameters(remove_duplicate=False))
    out = {}
    for k, v in grads.model.state_dict().items():
        full = v.full_tensor() if hasattr(v, "full_tensor") else v
        out[k] = gather_full_tensor(full, params[k], grads.mesh) if k in params else full.detach().clone()
    return out


def load_fsdp_model_state(grads: FullyShardedGrads, sd: dict[str, torch.Tensor]) -> None:
    """This rank's piece (its tp slice, then its dim-0 dp shard) of full tensors into an FSDP2 model."""
    params = dict(grads.model.named_parameters(remove_duplicate=False))
    with torch.no_grad():
        for k, t in grads.model.state_dict().items():
            src = shard_of(sd[k], params[k], grads.mesh) if k in params else sd[k]
            local = _local(t)
            if hasattr(t, "to_local") and local.numel():
                start = _dim0_start(src.shape[0], *grads._shard_of(params.get(k, t)))
                src = src[start:start + local.shape[0]]
            if local.numel():
                local.copy_(src)
