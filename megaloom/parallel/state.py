"""Layout-free checkpoint state of a tensor-parallel model: full tensors under the usual names.

Saving gathers every tp-sharded parameter and its optimizer state (exp_avg, ...) to full size, so the files
do not depend on the layout and a run saved at tp=2 resumes at tp=1 or tp=4. All ranks hold the same full
tensors and DCP deduplicates them, writing each once. Loading reads full tensors and keeps this rank's slice.
(Gathering costs memory at very large scale; DTensor shards written in place are the checkpoint issue's
next step.)
"""

from __future__ import annotations

import torch
from torch import nn

from megaloom.parallel.layout import layout_of, single_model_name
from megaloom.parallel.mesh import Mesh
from megaloom.parallel.tensor import _gather_full


def shard_of(full: torch.Tensor, p: nn.Parameter, mesh: Mesh) -> torch.Tensor:
    """This rank's slice of a full tensor shaped like parameter `p`'s full size."""
    return layout_of(p).shard(full, mesh.tp_rank, mesh.tp, mesh.ep_rank, mesh.ep)


def full_model_state(model: nn.Module, mesh: Mesh) -> dict[str, torch.Tensor]:
    """Every parameter and buffer full-size under its name: FSDP2 (ZeRO-3) shards are gathered over dp
    (`full_tensor`), tensor-parallel shards over tp. Collective when either is sharded."""
    sd = model.state_dict()
    params = dict(model.named_parameters(remove_duplicate=False))
    out = {}
    for k, v in sd.items():
        full = v.full_tensor() if hasattr(v, "full_tensor") else v
        out[k] = _gather_full(full, params[k], mesh, sum_replicas=False) if k in params else full
    return out


def full_optim_state(model: nn.Module, optimizer: torch.optim.Optimizer, mesh: Mesh) -> dict:
    """{'state': {fqn: {name: full tensor}}} keyed by parameter names. A ZeRO optimizer gathers its shards."""
    if hasattr(optimizer, "full_state"):
        return optimizer.full_state()
    names = {id(p): single_model_name(n, p) for n, p in model.named_parameters()}
    state: dict[str, dict] = {}
    for p, st in optimizer.state.items():
        state[names[id(p)]] = {k: (_gather_full(v, p, mesh, sum_replicas=False)
                                   if torch.is_tensor(v) and v.shape == p.shape and v.ndim > 0 else v)
                               for k, v in st.items()}
    # Only tensors are saved: hyper-parameters come from the config, so loading unpickles nothing.
    return {"state": state}


def ensure_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Create a fresh optimizer's state (zeros), so that a checkpoint can be loaded into it in place. A ZeRO
    optimizer creates its state when it is built."""
    if hasattr(optimizer, "segments"):
        return
    for p in model.parameters():
        if p.requires_grad and p not in optimizer.state:
            _init_adam_state(optimizer, p)


def _init_adam_state(optimizer: torch.optim.Optimizer, p: nn.Parameter) -> None:
    on_device = optimizer.defaults.get("fused") or optimizer.defaults.get("capturable")
    optimizer.state[p] = {"step": torch.zeros((), dtype=torch.float32, device=p.device if on_device else "cpu"),
                          "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                          "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}


def load_full_state(model: nn.Module, optimizer: torch.optim.Optimizer | None, model_sd: dict,
                    optim_sd: dict | None, mesh: Mesh) -> None:
    if optimizer is not None and hasattr(optimizer, "load_full_state"):  # ZeRO: keep this rank's pieces
        optimizer.load_full_model_state(model_sd)
        if optim_sd is not None:
            optimizer.load_full_state(optim_sd)
        return
    params = dict(model.named_parameters(remove_duplicate=False))
    with torch.no_grad():
        for k, t in model.state_dict().items():
            src = model_sd[k]
            t.copy_(shard_of(src, params[k], mesh) if k in params else src)
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
