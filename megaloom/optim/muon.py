"""Muon (Jordan et al. 2024; Moonlight, Liu et al. 2025) for the blocks' weight matrices, AdamW for the rest.

Per weight matrix W (m x n) with gradient G, at each step:

    M = beta M + (1 - beta) G                 (momentum, sharded like any optimizer state)
    U = (1 - beta) G + beta M                 (Nesterov)
    O = NS5(U)                                (Newton-Schulz, 5 quintic steps in bf16: U's singular values -> ~1)
    W = W (1 - lr wd) - lr * 0.2 sqrt(max(m, n)) * O

The factor 0.2 sqrt(max(m, n)) (Moonlight) gives the update the RMS of a typical AdamW update, so AdamW's learning
rate and weight decay carry over. Embeddings, the LM head, norms, biases and anything 1-D stay with torch's AdamW
(`is_muon_param`); stacked MoE experts [E, m, n] are E matrices, orthogonalised as one batch.

Distribution. Newton-Schulz is not elementwise: it needs the whole matrix, and megaloom holds it cut twice, by
tensor parallelism (rows or columns per tp rank, `Layout.tp_dim`) and, under ZeRO-1/2, by the flat data-parallel
segments of the tp-local tensor (`Segment`). The momentum and U are elementwise, so they are computed where the
state lives (sharded). Then, matrix by matrix, in the same order on every rank (Distributed Muon, as Moonlight's):

1. ZeRO: the tp-local U is assembled on one dp rank, a reduce of zero-filled flat buffers (each rank fills only its
   segment, so the sum is exact, x + 0 = x).
2. tp: that rank's tp group gathers the tp-local pieces on one tp rank (replicated KV heads counted once).
3. The owner orthogonalises the full matrix, scatters the tp pieces back, and the dp rank broadcasts the tp-local
   result to its dp group, where each rank keeps its segment.

The owner of matrix j is (dp, tp) index j mod (dp x tp): the Newton-Schulz work is spread round-robin over the ranks
holding pieces of the matrices. Only one matrix's gather buffer exists at a time (tp-local on every rank, full on
the owner): the bound the memory plan counts. Without ZeRO the dp replicas hold whole (tp-local) gradients and each
orthogonalises its own copy, as every replica runs its own AdamW: no dp traffic. Pipelines: each stage its own.
Expert parallelism: each ep rank holds whole experts; the ZeRO group of expert weights is edp.

Hand-written rather than a library's: torch has no distributed Muon (torch.optim.Muon, where present, takes whole
2-D tensors on one process), and Megatron-Core's rides on its own distributed optimizer; megaloom's shards are its
own `Segment`s and `Layout`s, so the gather is written against them.

Refused (ConfigError, megaloom/config.py): ZeRO-3 (FSDP2 shards rows of every matrix across dp with no hook between
reduce-scatter and update to gather them), the 1-bit optimizers (a different optimizer), overlap_optimizer.

QK-clip (MuonClip, Kimi K2; ``train.muon_qk_clip`` = tau > 0; megaloom/optim/qk_clip.py, installed as
``after_step``): attention modules measure the largest pre-softmax logit of each head during the step's forwards
(megaloom/models/attention.py, behind the flag); after the step the max over data-parallel ranks is taken and,
where a head's exceeds tau, with gamma = tau / max, its W_q rows are scaled by sqrt(gamma) and its K head's rows by
sqrt of the smallest gamma of the query heads sharing that K head (multi-head attention: exactly gamma).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from megaloom import accelerator
from megaloom.config import ConfigError
from megaloom.optim.zero import STEP_GROUP_ELEMENTS, ShardedOptimizer, step_groups
from megaloom.parallel import comm
from megaloom.parallel.expert import is_expert_param
from megaloom.parallel.layout import layout_of
from megaloom.parallel.mesh import Mesh

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # Jordan's quintic: fast growth of small singular values
RMS_MATCH = 0.2  # Moonlight: 0.2 sqrt(max(m, n)) makes an orthogonal update's RMS that of AdamW's (~0.2-0.4)


def is_muon_param(name: str, p: torch.Tensor) -> bool:
    """Whether Muon updates ``name``: a 2-D weight (3-D: a stack of expert matrices) inside a transformer block.
    Embeddings, the head, norms and biases are not in blocks or not 2-D; LoRA adapters (low rank by design) and
    a vision tower's blocks stay with AdamW too."""
    parts = name.split(".")
    if p.ndim not in (2, 3) or "layers" not in parts[:-1]:
        return False
    return not any("emb" in s or "lora" in s or s in ("vision", "visual") for s in parts)


def newton_schulz(g: torch.Tensor, steps: int = 5, dtype: torch.dtype = torch.bfloat16,
                  eps: float = 1e-7) -> torch.Tensor:
    """The orthogonal factor U V^T of ``g`` (the last two dims; leading dims are a batch), approximately: Jordan's
    quintic iteration in ``dtype``, on the wide orientation (X X^T is the smaller Gram matrix). Returned in
    ``g``'s dtype; its singular values land near 1 (in about [0.7, 1.2])."""
    a, b, c = NS_COEFFICIENTS
    x = g.to(dtype)
    tall = g.size(-2) > g.size(-1)
    if tall:
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + eps)  # spectral norm <= Frobenius norm <= 1
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * (gram @ gram)) @ x
    if tall:
        x = x.mT
    return x.to(g.dtype)


def update_scale(full_shape: Sequence[int]) -> float:
    """Moonlight's RMS match for a matrix of ``full_shape`` (the last two dims; the whole matrix, not a tp shard)."""
    return RMS_MATCH * math.sqrt(max(full_shape[-2], full_shape[-1]))


# The three rooted collectives the exchange needs (comm.py has the all-to-all kinds), recorded like comm's own.


def _reduce_to(tensor: torch.Tensor, dst: int, group: comm.Group,
               recorder: comm.OpRecorder | None = None) -> torch.Tensor:
    """Sum ``tensor`` over the group into group rank ``dst``'s ``tensor`` (the others' are left undefined)."""
    if comm.group_size(group) > 1:
        with comm._recording(recorder, "reduce", group, comm.buffer_bytes(tensor)):
            dist.reduce(tensor, dst=dist.get_global_rank(group, dst), group=group)
    return tensor


def _gather_to(tensor: torch.Tensor, dst: int, group: comm.Group,
              recorder: comm.OpRecorder | None = None) -> list[torch.Tensor] | None:
    """Every rank's ``tensor`` (same shape everywhere) on group rank ``dst``, in group-rank order; None elsewhere."""
    size = comm.group_size(group)
    if size == 1:
        return [tensor]
    mine = group.rank() == dst
    out = [torch.empty_like(tensor) for _ in range(size)] if mine else None
    with comm._recording(recorder, "gather", group, comm.buffer_bytes(tensor) * size):
        dist.gather(tensor.contiguous(), out, dst=dist.get_global_rank(group, dst), group=group)
    return out


def _scatter_from(output: torch.Tensor, chunks: list[torch.Tensor] | None, src: int, group: comm.Group,
                 recorder: comm.OpRecorder | None = None) -> torch.Tensor:
    """comm.Group rank ``src``'s ``chunks[r]`` (one per group rank, each shaped like ``output``) into rank r's
    ``output``; ``chunks`` matters on ``src`` only."""
    if comm.group_size(group) == 1:
        return output.copy_(chunks[0])
    send = [c.contiguous() for c in chunks] if group.rank() == src else None
    with comm._recording(recorder, "scatter", group, comm.buffer_bytes(output) * comm.group_size(group)):
        dist.scatter(output, send, src=dist.get_global_rank(group, src), group=group)
    return output


@dataclass
class Matrix:
    """One Muon matrix as this rank sees it. ``param``: the model's (tp-local) parameter; ``tensor``: the
    optimizer's tensor standing for it here (the parameter itself, or this rank's ZeRO segment of it, flat), None
    when this rank holds no piece; ``start``: the segment's flat offset in the tp-local parameter; ``dp_group``:
    the ranks holding the other flat segments (ZeRO), None when the tensor is the whole tp-local parameter."""

    param: nn.Parameter
    tensor: torch.Tensor | None
    start: int = 0
    dp_group: comm.Group = None


def full_shape(p: torch.Tensor, mesh: Mesh) -> list[int]:
    """The whole parameter's shape (tp and ep undone) from its tp-local shape."""
    return layout_of(p).box(list(p.shape), mesh.tp_rank, mesh.tp, mesh.ep_rank, mesh.ep)[0]


class MatrixExchange:
    """Assembles each matrix's update on its owner rank, orthogonalises it there, and returns every rank its
    piece (module docstring, steps 1-3)."""

    def __init__(self, mesh: Mesh, steps: int, dtype: torch.dtype) -> None:
        self.mesh, self.steps, self.dtype = mesh, steps, dtype
        self.peak_elements = 0  # the largest gather buffer met (elements, on an owner): the memory plan's bound

    def _tp_split(self, p: torch.Tensor) -> bool:
        return self.mesh.tp > 1 and layout_of(p).tp_dim is not None

    def orthogonalised(self, j: int, m: Matrix, u: torch.Tensor | None) -> torch.Tensor | None:
        """NS5 of matrix ``j``'s update, this rank's piece of it (shaped like ``u``); ``u``: this rank's piece of
        the update (None where it holds none: it still takes part in the collectives)."""
        shape, rec = tuple(m.param.shape), self.mesh.recorder
        dp = comm.group_size(m.dp_group)
        tp = self.mesh.tp if self._tp_split(m.param) else 1
        dp_owner, tp_owner = divmod(j % (dp * tp), tp)
        if dp == 1:
            return self._over_tp(u.reshape(shape), m.param, tp, tp_owner).view_as(u)
        local = torch.zeros(math.prod(shape), dtype=torch.float32, device=m.param.device)
        if u is not None:
            local[m.start:m.start + u.numel()] = u.reshape(-1)
        _reduce_to(local, dp_owner, m.dp_group, rec)
        if comm.group_rank(m.dp_group) == dp_owner:
            local = self._over_tp(local.view(shape), m.param, tp, tp_owner)
        comm.broadcast(local, dist.get_global_rank(m.dp_group, dp_owner), m.dp_group, rec)
        return None if u is None else local.reshape(-1)[m.start:m.start + u.numel()].view_as(u)

    def _over_tp(self, local: torch.Tensor, p: torch.Tensor, tp: int, owner: int) -> torch.Tensor:
        """NS5 of the whole matrix whose tp-local piece is ``local``: gathered on tp rank ``owner``, scattered back."""
        if tp == 1:
            self.peak_elements = max(self.peak_elements, local.numel())
            return newton_schulz(local, self.steps, self.dtype)
        lay = layout_of(p)
        pieces = _gather_to(local, owner, self.mesh.tp_group, self.mesh.recorder)
        chunks = None
        if pieces is not None:  # the owner: replicated KV heads (tp_replicas > 1) counted once
            full = torch.cat(pieces[::lay.tp_replicas], dim=lay.tp_dim)
            self.peak_elements = max(self.peak_elements, full.numel() * 2)  # the gathered pieces and the matrix
            parts = newton_schulz(full, self.steps, self.dtype).chunk(tp // lay.tp_replicas, dim=lay.tp_dim)
            chunks = [parts[r // lay.tp_replicas] for r in range(tp)]
        return _scatter_from(torch.empty_like(local), chunks, owner, self.mesh.tp_group, self.mesh.recorder)


class Muon(torch.optim.Optimizer):
    """Muon over ``matrices`` and torch's AdamW over ``adamw_groups``, one optimizer (one ``param_groups`` list
    for the learning rate schedule, one ``state`` for checkpoints: Muon's entries hold ``step`` and
    ``momentum_buffer``, AdamW's its own). ``mesh``: where the matrices' other pieces live (`MatrixExchange`).
    ``after_step``: called after every step (QK-clip)."""

    def __init__(self, matrices: list[Matrix], adamw_groups: list[dict], mesh: Mesh, lr: float = 1e-3,
                 momentum: float = 0.95, ns_steps: int = 5, weight_decay: float = 0.0,
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8, fused: bool = False,
                 ns_dtype: torch.dtype = torch.bfloat16) -> None:
        if not 0 <= momentum < 1 or ns_steps < 1:
            raise ValueError(f"invalid Muon hyper-parameters momentum={momentum} ns_steps={ns_steps}")
        self.matrices, self.mesh = matrices, mesh
        self.exchange = MatrixExchange(mesh, ns_steps, ns_dtype)
        self.scales = [update_scale(full_shape(m.param, mesh)) for m in matrices]
        adam = [g for g in adamw_groups if g["params"]]
        self.adamw = torch.optim.AdamW(adam, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=fused,
                                       foreach=None if fused else True) if adam else None
        muon_group = {"params": [m.tensor for m in matrices if m.tensor is not None], "use_muon": True,
                      "weight_decay": weight_decay}
        groups = [muon_group] + (self.adamw.param_groups if self.adamw is not None else [])
        super().__init__(groups, dict(lr=lr, momentum=momentum, weight_decay=weight_decay, use_muon=False))
        if self.adamw is not None:
            self.adamw.state = self.state  # one state: checkpoints and the memory count see both kinds
        self.after_step: Callable[[], None] | None = None
        step_device = next(iter(adam[0]["params"])).device if adam and fused else torch.device("cpu")
        for m in matrices:  # eagerly: memory is what it will be, and a checkpoint has a template to load into
            if m.tensor is not None:
                self.state[m.tensor] = {"step": torch.zeros((), dtype=torch.float32),
                                        "momentum_buffer": torch.zeros_like(m.tensor)}
        for g in adam:
            for p in g["params"]:
                self.state[p] = {"step": torch.zeros((), dtype=torch.float32, device=step_device),
                                 "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        if self.adamw is not None:  # torch's load replaces the state dict: share the new one again
            self.adamw.state = self.state

    @torch.no_grad()
    def step(self, closure: Callable | None = None) -> None:
        if closure is not None:
            raise ValueError("Muon.step takes no closure")
        if self.adamw is not None:
            self.adamw.step()
        group = self.param_groups[0]
        lr, beta, wd = group["lr"], group["momentum"], group["weight_decay"]
        for j, m in enumerate(self.matrices):
            u = self._nesterov(m.tensor, beta) if m.tensor is not None else None
            o = self.exchange.orthogonalised(j, m, u)
            if m.tensor is not None:
                if wd:
                    m.tensor.mul_(1 - lr * wd)
                m.tensor.add_(o, alpha=-lr * self.scales[j])
        if self.after_step is not None:
            self.after_step()

    def _nesterov(self, t: torch.Tensor, beta: float) -> torch.Tensor:
        """Momentum update in place; returns the Nesterov direction (1 - beta) g + beta m (elementwise)."""
        st = self.state[t]
        g = t.grad if t.grad is not None else torch.zeros_like(t)  # still takes part in the exchange
        st["step"] += 1
        st["momentum_buffer"].lerp_(g, 1 - beta)
        return g.lerp(st["momentum_buffer"], beta)

    def gather_elements(self) -> int:
        """Elements of the largest transient gather buffer this rank held (0 before the first step)."""
        return self.exchange.peak_elements


def split_params(named: list[tuple[str, nn.Parameter]], weight_decay: float
                 ) -> tuple[list[tuple[str, nn.Parameter]], list[dict]]:
    """(Muon's (name, parameter) pairs, AdamW's groups with megaloom's decay rule) of the trainable ``named``."""
    muon, decay, no_decay, seen = [], [], [], set()
    for name, p in named:
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        if is_muon_param(name, p):
            muon.append((name, p))
        else:
            (decay if p.ndim >= 2 else no_decay).append(p)
    return muon, [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_muon(model: nn.Module, mesh: Mesh, lr: float, weight_decay: float, betas: tuple[float, float],
               momentum: float = 0.95, ns_steps: int = 5, eps: float = 1e-8, fused: bool = False,
               ns_dtype: torch.dtype = torch.bfloat16) -> Muon:
    """Muon over whole (possibly tensor-parallel) parameters: no ZeRO (parallel.zero=0), any tp / pp / ep."""
    muon, adamw_groups = split_params(list(model.named_parameters()), weight_decay)
    return Muon([Matrix(p, p) for _, p in muon], adamw_groups, mesh, lr=lr, momentum=momentum, ns_steps=ns_steps,
                weight_decay=weight_decay, betas=betas, eps=eps, fused=fused, ns_dtype=ns_dtype)


class ShardedMuon(ShardedOptimizer):
    """Muon under ZeRO-1/2: the momentum of this rank's segments only (as AdamW's state), the updates assembled
    per matrix by `MatrixExchange`. Everything else (segments, fp32 masters, parameter gathers, hooks,
    checkpoints) is ShardedOptimizer's."""

    kinds = ("muon",)

    def __init__(self, layout, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
                 weight_decay: float = 0.0, momentum: float = 0.95, ns_steps: int = 5,
                 ns_dtype: torch.dtype = torch.bfloat16, overlap_param_gather: bool = True,
                 whole_modules: Sequence[nn.Module] = ()) -> None:
        if getattr(layout, "zero", 0) == 3:
            raise ConfigError("train.optimizer=muon with parallel.zero=3: FSDP2 shards every matrix by rows over "
                              "dp and updates the shards in place, with no step at which Muon could gather them; "
                              "set parallel.zero=1 or 2 (the state stays sharded) or train.optimizer=adamw.")
        self.muon_settings = dict(momentum=momentum, ns_steps=ns_steps, ns_dtype=ns_dtype)
        super().__init__(layout, "muon", lr, betas, eps, weight_decay, overlap_param_gather, whole_modules)

    def _build_inner(self, split: list[tuple[list[int], float]], lr: float, betas: tuple[float, float],
                     eps: float, weight_decay: float, device: torch.device) -> torch.optim.Optimizer:
        mesh = self.mesh
        seg_of: dict[int, int] = {}
        for i, s in enumerate(self.segments):
            if s.owner in seg_of:
                raise RuntimeError(f"ZeRO: parameter {self.named_params[s.owner][0]} has two segments on a rank")
            seg_of[s.owner] = i
        matrices, muon_segments = [], set()
        for owner, (name, p) in enumerate(self.named_params):
            if not is_muon_param(name, p):
                continue
            i = seg_of.get(owner)
            group = mesh.edp_group if mesh.ep > 1 and is_expert_param(p) else self.layout.group
            matrices.append(Matrix(p, None if i is None else self.tensors[i],
                                   0 if i is None else self.segments[i].start, group))
            if i is not None:
                muon_segments.add(i)
        fused = accelerator.fused_optimizer(device)
        adam = [([i for i in idx if i not in muon_segments], wd) for idx, wd in split]
        if not fused:  # the foreach AdamW's temporary bounded, as ShardedOptimizer's
            adam = [(part, wd) for idx, wd in adam
                    for part in step_groups(idx, [self.tensors[i].numel() for i in idx], STEP_GROUP_ELEMENTS)]
        groups = [{"params": [self.tensors[i] for i in idx], "weight_decay": wd} for idx, wd in adam if idx]
        return Muon(matrices, groups, mesh, lr=lr, weight_decay=weight_decay, betas=betas, eps=eps, fused=fused,
                    **self.muon_settings)
