"""LAMB (You et al. 2019, "Large Batch Optimization for Deep Learning"): Adam with a per-layer trust ratio.

Per parameter w with gradient g, at step t (1-based):

    m = b1 m + (1 - b1) g            v = b2 v + (1 - b2) g^2
    u = (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps) + wd * w
    w = w - lr * r * u,   r = ||w|| / ||u||, or 1 when either norm is 0

The norms are of the whole parameter. When a parameter is split (tensor-parallel shards, or the flat
optimizer shards of ZeRO) each piece only knows part of them, so the update is done in two passes: every
tensor's partial squared norms are computed, handed to a ``norm_sync`` function that turns them into the
full per-parameter squared norms (summing pieces over the groups that hold them), then the step is taken.
`tp_norm_sync` does this over tensor parallelism; megaloom.optim.zero builds one for ZeRO shards.
The state keys (exp_avg, exp_avg_sq, step) are AdamW's, so checkpoints keep one layout.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from megaloom.optim.param_groups import param_groups
from megaloom.parallel import comm
from megaloom.parallel.expert import is_expert_param
from megaloom.parallel.grad_norm import DeviceConstants
from megaloom.parallel.layout import layout_of
from megaloom.parallel.mesh import Mesh

NormSync = Callable[[torch.Tensor], torch.Tensor]  # [n_tensors, 2] partial (||w||^2, ||u||^2) -> full per row


def trust_ratio(w_sq: torch.Tensor, u_sq: torch.Tensor) -> torch.Tensor:
    """||w|| / ||u|| elementwise over squared norms, 1 where either is 0 (a fresh zero bias, a zero update)."""
    ok = (w_sq > 0) & (u_sq > 0)
    return torch.where(ok, w_sq.clamp_min(1e-30).sqrt() / u_sq.clamp_min(1e-30).sqrt(), torch.ones_like(w_sq))


def tp_norm_sync(params: list[torch.Tensor], mesh: Mesh) -> NormSync | None:
    """Full per-parameter squared norms of tensor-parallel parameters (rows in the order of ``params``):
    weighted local squares summed over tp, and for expert-parallel stacks (each ep rank holds other experts)
    over ep first. None when every tensor is a whole parameter (tp == 1, no expert parallelism)."""
    expert = [mesh.ep > 1 and is_expert_param(p) for p in params]
    if mesh.tp == 1 and not any(expert):
        return None
    weights = [layout_of(p).norm_weight(mesh.tp) for p in params]  # per parameter: copies over tp only
    constants = DeviceConstants()  # on the device once, not copied from the host every step

    def sync(partial: torch.Tensor) -> torch.Tensor:
        w = constants.get("weights", partial.device, lambda: torch.tensor(weights, dtype=torch.float32)[:, None])
        full = partial * w
        if any(expert):
            mask = constants.get("is_expert", partial.device, lambda: torch.tensor(expert)[:, None])
            over_ep = comm.all_reduce(full * mask, mesh.ep_group, recorder=mesh.recorder)
            full = torch.where(mask, over_ep, full)
        return comm.all_reduce(full, mesh.tp_group, recorder=mesh.recorder)

    sync.constants = constants
    return sync


class Lamb(torch.optim.Optimizer):
    """LAMB over whole (or tensor-parallel) parameters. ``norm_sync``: see the module docstring; None means
    every tensor is a whole parameter. Decoupled weight decay goes into the update before the trust ratio,
    as in the paper; parameter groups with weight_decay=0 (biases, norms) get none."""

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.0, norm_sync: NormSync | None = None) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0 or not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"invalid LAMB hyper-parameters lr={lr} betas={betas} eps={eps} "
                             f"weight_decay={weight_decay}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.norm_sync = norm_sync
        self.last_ratios: torch.Tensor | None = None  # the last step's trust ratios, one per tensor (1-bit LAMB)

    def init_state(self, p: torch.Tensor) -> dict:
        st = self.state[p]
        if not st:
            st["step"] = torch.zeros((), dtype=torch.float32)
            st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return st

    @torch.no_grad()
    def step(self, closure: Callable | None = None) -> torch.Tensor | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # Every tensor takes part (a missing gradient counts as zero) so that the norm exchange has the same
        # rows on every rank.
        rows: list[tuple[dict, torch.Tensor, torch.Tensor]] = []
        partial = []
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                st = self.init_state(p)
                g = p.grad if p.grad is not None else torch.zeros_like(p)
                st["step"] += 1
                t = float(st["step"])
                st["exp_avg"].lerp_(g, 1 - b1)
                st["exp_avg_sq"].mul_(b2).addcmul_(g, g, value=1 - b2)
                denom = (st["exp_avg_sq"] / (1 - b2**t)).sqrt_().add_(group["eps"])
                u = (st["exp_avg"] / (1 - b1**t)).div_(denom)
                if group["weight_decay"]:
                    u.add_(p, alpha=group["weight_decay"])
                rows.append((group, p, u))
                partial.append(torch.stack([p.float().pow(2).sum(), u.float().pow(2).sum()]))
        if not rows:
            return loss
        sq = torch.stack(partial)
        if self.norm_sync is not None:
            sq = self.norm_sync(sq)
        ratios = self.last_ratios = trust_ratio(sq[:, 0], sq[:, 1])
        for i, (group, p, u) in enumerate(rows):
            p.add_(u.mul_(ratios[i].to(u.dtype)), alpha=-group["lr"])  # the ratio stays on the device: no sync
        return loss


def build_lamb(model: torch.nn.Module, weight_decay: float, lr: float, betas: tuple[float, float],
               eps: float = 1e-6, mesh: Mesh | None = None) -> Lamb:
    """LAMB over ``model`` with megaloom's decay rule (none on 1-D tensors), tensor-parallel aware."""
    groups = param_groups(model, weight_decay)
    params = [p for g in groups for p in g["params"]]
    return Lamb(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                norm_sync=tp_norm_sync(params, mesh) if mesh is not None else None)
