"""Tensor (+ sequence) parallelism, applied to a built, initialised model by reading its family's plan.

`parallelize_tensor` walks the model's submodules, looks each name up in the plan (`megaloom.models.plan_styles`,
e.g. `megaloom.models.plan.DECODER_PLAN`) and applies the style in place: linear layers and the embedding are
swapped for their tensor-parallel versions (`tp_layers.py`), region entries become forward pre-hooks, and each
parameter gets its `Layout` (`layout.py`). Shards live under the original parameter names
(``layers.0.attn.q_proj.weight`` is this rank's rows) and are copied from the already-initialised full
weights, so the same seed gives the same model as a single process.

"Enter region" (style `Region`) is a forward pre-hook on the attention / MLP module: identity forward +
all-reduce backward (copy_to_tp), or with sequence parallelism an all-gather of the sequence shards in the
compute dtype, done once for q, k and v together, whose column-parallel linears then run as one autograd node
that saves only this rank's shard and re-gathers it in backward (`sp_linear.SeqRegion`). With sp the
embedding reduce-scatters its partial lookups into sequence shards, the residual stream holds T/tp tokens per
rank, and the head's input is all-gathered again (`VocabHead`); the loss is the vocab-parallel cross-entropy,
so full logits never exist.

When tp > n_kv_heads, each rank holds one KV head (rank r: head r // (tp / n_kv_heads)), which serves its
local query heads exactly as grouped-query attention maps them (q head h uses kv head h // (n_heads /
n_kv_heads)). The replicas' gradients are partial and are summed by `sync_tp_grads`.

After backward (and before the data-parallel reduction and clipping) call `sync_tp_grads(model, mesh)`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fnmatch import fnmatchcase

import torch
from torch import nn

from megaloom.config import ModelConfig
from megaloom.model_keys.shape import resolved_head_dim, resolved_kv_heads
from megaloom.models import plan_styles as st
from megaloom.models.moe import MoE
from megaloom.parallel import borders, comm
from megaloom.parallel.expert import parallelize_moe
from megaloom.parallel.layout import layout_of, set_layout
from megaloom.parallel.mesh import Mesh, check_tp_model
from megaloom.parallel.random import ForkedCall, ForkedDropout, RNGTracker
from megaloom.parallel.sp_linear import SeqRegion
from megaloom.parallel.tp_layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from megaloom.parallel.vocab_ce import VocabParallelLoss, gather_vocab_logits, vocab_parallel_cross_entropy

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "VocabParallelLoss",
           "allreduce_kv_replica_grads", "allreduce_sequence_parallel_grads", "gather_full_grads",
           "gather_full_params", "gather_full_tensor", "gather_vocab_logits", "parallelize_tensor",
           "sync_tp_grads", "vocab_parallel_cross_entropy"]


class _EnterRegion:
    """Forward pre-hook on an attention / MLP module without sp: its first positional input enters the tp
    region (with sp: `sp_linear.SeqRegion`)."""

    def __init__(self, mesh: Mesh) -> None:
        self.mesh = mesh

    def __call__(self, module: nn.Module, args: tuple) -> tuple:
        return (borders.copy_to_tp(args[0], self.mesh.tp_group, self.mesh.recorder),) + tuple(args[1:])


class _SplitToSeq:
    """This rank's sequence shard of a replicated [B, T, ...] tensor; the gradient all-gathered in backward."""

    def __init__(self, mesh: Mesh) -> None:
        self.mesh = mesh

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return borders.scatter_to_seq(x, self.mesh.tp_group, self.mesh.recorder)


class _FirstOfSeq:
    """The hidden state at position 0 from sequence shards: each rank's first token all-gathered, tp rank 0's kept;
    backward keeps each rank's own slice of the (replicated) gradient, so only rank 0's shard receives it."""

    def __init__(self, mesh: Mesh) -> None:
        self.mesh = mesh

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        firsts = borders.gather_from_seq_replicated(x[:, :1].contiguous(), self.mesh.tp_group, self.mesh.recorder)
        return firsts[:, 0]


class SequencePositionEmbedding(nn.Module):
    """A learned position embedding (or BERT's segment embedding) under sp: the rows of this rank's sequence shard
    (same Parameter, so the name ``pos_emb.weight`` and checkpoints are unchanged; its gradient is a partial sum
    over tp)."""

    def __init__(self, emb: nn.Embedding, mesh: Mesh) -> None:
        super().__init__()
        self.weight, self.mesh = set_layout(emb.weight, tp_partial=True), mesh
        self.num_embeddings, self.embedding_dim = emb.weight.shape

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        n = positions.shape[-1] // self.mesh.tp
        return nn.functional.embedding(positions[..., self.mesh.tp_rank * n:(self.mesh.tp_rank + 1) * n],
                                       self.weight)


@dataclass
class _Context:
    """What the styles need to split one model: the mesh, sp, the model's shape, the dropout RNG streams."""

    mesh: Mesh
    sp: bool
    cfg: ModelConfig
    tracker: RNGTracker
    ring: bool = False  # parallel.async_tp: sp's all-gathers / reduce-scatters as ring steps under the GEMMs
    regions: list = field(default_factory=list)  # (SeqRegion, module): bound once the plan has split the children

    @property
    def kv_rows(self) -> tuple[tuple[int, int] | None, int]:
        """(rows, replicas) of a k/v projection: this rank's single KV head when tp > n_kv_heads."""
        n_kv = resolved_kv_heads(self.cfg)
        if self.mesh.tp <= n_kv:
            return None, 1
        reps, head_dim = self.mesh.tp // n_kv, resolved_head_dim(self.cfg)
        return ((self.mesh.tp_rank // reps) * head_dim, head_dim), reps


def _accepts(style: st.Style, module: nn.Module) -> bool:
    if isinstance(style, st.Experts):
        return isinstance(module, MoE)
    if isinstance(style, st.Region):  # an MoE layer enters and leaves its regions itself (parallel/expert.py)
        return not isinstance(module, MoE)
    return True


def _mark_partial(module: nn.Module) -> None:
    for p in module.parameters():
        set_layout(p, tp_partial=True)


def _apply(style: st.Style, module: nn.Module, ctx: _Context) -> nn.Module | None:
    """Apply one style to ``module``; returns the module that replaces it, or None (changed in place)."""
    mesh, sp = ctx.mesh, ctx.sp
    match style:
        case st.Colwise(kv_heads=True):
            rows, reps = ctx.kv_rows
            return ColumnParallelLinear.from_linear(module, mesh, "none", rows, reps)
        case st.Colwise(replicated=True):  # all rows on every rank, one replica per tp rank
            return ColumnParallelLinear.from_linear(module, mesh, "none", (0, module.out_features), mesh.tp)
        case st.Colwise(region_input=reads_input):
            col = ColumnParallelLinear.from_linear(module, mesh, "none")
            col.region_input = reads_input
            return col
        case st.Rowwise(sequence=seq):
            row = RowParallelLinear.from_linear(module, mesh, "reduce_scatter" if sp and seq else "reduce")
            row.ring = sp and seq and ctx.ring
            return row
        case st.Region(sequence=True) if sp:  # gathered once; its column-parallel linears save only this rank's shard
            region = SeqRegion(mesh, ring=ctx.ring)
            ctx.regions.append((region, module))
            module.register_forward_pre_hook(region.enter)
            module.register_forward_hook(region.leave)
        case st.Region():
            module.register_forward_pre_hook(_EnterRegion(mesh))
        case st.LocalHeads() if ctx.cfg.dropout > 0:  # attention probabilities of this rank's heads
            module._core = ForkedCall(module._core, ctx.tracker)
        case st.VocabEmbedding():
            return VocabParallelEmbedding.from_embedding(module, mesh, "reduce_scatter" if sp else "reduce")
        case st.SequencePositions() if sp:
            return SequencePositionEmbedding(module, mesh)
        case st.SequenceFirst() if sp:
            module.first = _FirstOfSeq(mesh)
        case st.VocabHead():
            head = ColumnParallelLinear.from_linear(module, mesh, "gather" if sp else "copy")
            head.ring = sp and ctx.ring
            return head
        case st.VocabLoss():
            return VocabParallelLoss(mesh)
        case st.SequenceParallel() if sp:
            _mark_partial(module)
        case st.PartialGrad():
            _mark_partial(module)
        case st.SequenceDropout() if sp and ctx.cfg.dropout > 0:  # ranks hold different tokens
            return ForkedDropout(ctx.cfg.dropout, ctx.tracker)
        case st.SequenceScatter() if sp:
            module.split = _SplitToSeq(mesh)
        case st.Experts():
            parallelize_moe(module, mesh, sp)
    return None


def _plan_entry(plan: st.Plan, name: str) -> tuple[st.Style, ...]:
    for pattern, styles in plan.items():
        if fnmatchcase(name, pattern):
            return styles if isinstance(styles, tuple) else (styles,)
    return ()


def apply_plan(model: nn.Module, plan: st.Plan, ctx: _Context) -> None:
    """Walk ``model``'s submodules (parents first) and apply each one's styles from ``plan``."""
    owned: list[str] = []  # subtrees a style split whole (MoE layers)
    for name, module in list(model.named_modules()):
        if not name or any(name.startswith(o + ".") for o in owned):
            continue
        for style in _plan_entry(plan, name):
            if not _accepts(style, module):
                continue
            new = _apply(style, module, ctx)
            if new is not None:
                parent, _, leaf = name.rpartition(".")
                setattr(model.get_submodule(parent) if parent else model, leaf, new)
                module = new
            if style.owns_subtree:
                owned.append(name)


def with_mtp(plan: st.Plan) -> st.Plan:
    """``plan`` for a model with multi-token prediction (models/mtp.py): each module's block split as the model's
    blocks are (the family's own entries included), its norms and input projection replicated on the residual
    stream (with sp they see this rank's tokens: partial gradients)."""
    blocks = {"mtp.*.block." + k[len("layers.*."):]: v for k, v in plan.items() if k.startswith("layers.*.")}
    stream = {f"mtp.*.{n}": st.SequenceParallel() for n in ("enorm", "hnorm", "eh_proj", "norm")}
    return {**plan, **blocks, **stream}


def parallelize_tensor(model: nn.Module, mesh: Mesh, sp: bool, plan: st.Plan | None = None,
                       async_tp: bool = False, overlap: bool = False) -> nn.Module:
    """Split ``model`` over ``mesh.tp`` (and its MoE experts over ``mesh.ep``) in place, parameter names
    unchanged, following ``plan`` (default: the plan of the model's family, ``model.plan``). ``async_tp``
    (with sp): the region borders as collective matmuls (`collective_matmul`, eager). ``overlap`` (with sp): the
    borders of compiled blocks in the forms Inductor's micro-pipeline TP pass fuses with their GEMMs
    (`borders`' traced form; the same collectives, so the same results)."""
    plan = plan if plan is not None else model.plan
    if getattr(model, "mtp", None) is not None:  # multi-token prediction's modules, split as the blocks are
        plan = with_mtp(plan)
    if mesh.tp == 1:
        if mesh.ep > 1:  # expert parallelism alone
            only_experts = {k: v for k, v in plan.items()
                            if any(isinstance(s, st.Experts) for s in (v if isinstance(v, tuple) else (v,)))}
            apply_plan(model, only_experts, _Context(mesh, False, model.cfg, RNGTracker.for_mesh(mesh)))
        return model
    if isinstance(getattr(model, "tok_emb", None), VocabParallelEmbedding):
        raise ValueError("parallelize_tensor: this model is already tensor-parallel")
    check_tp_model(model.cfg, mesh.tp)
    tied = model.tie_embeddings_active()
    ctx = _Context(mesh, sp, model.cfg, RNGTracker.for_mesh(mesh), ring=sp and async_tp)
    apply_plan(model, plan, ctx)
    for region, module in ctx.regions:  # before any forward: a compiled block's first trace then sees them bound
        region.bind(module)
        region.overlap = sp and overlap
    if sp and overlap:
        for m in model.modules():
            if isinstance(m, (ColumnParallelLinear, RowParallelLinear)):
                m.overlap = True
    if tied:  # the head shares the embedding's (vocabulary-split) rows
        model.head.weight = model.tok_emb.weight
    return model


def _allreduce_flat(grads: list[torch.Tensor], mesh: Mesh) -> None:
    """One collective for many small gradients (per dtype), written back in place."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for group in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in group])
        comm.all_reduce(flat, mesh.tp_group, recorder=mesh.recorder)
        for g, part in zip(group, flat.split([g.numel() for g in group]), strict=True):
            g.copy_(part.view_as(g))


def allreduce_sequence_parallel_grads(model: nn.Module, mesh: Mesh) -> None:
    """Sum over tp the gradients of replicated weights that saw only this rank's tokens (sp norms, biases)."""
    if mesh.tp == 1:
        return
    grads = [p.grad for p in model.parameters() if layout_of(p).tp_partial and p.grad is not None]
    if grads:
        _allreduce_flat(grads, mesh)


def allreduce_kv_replica_grads(model: nn.Module, mesh: Mesh) -> None:
    """Sum the gradients of replicated KV heads over the tp ranks that hold the same head.

    Done with one all-reduce over the tp group of a [tp / replicas, n] buffer where each rank fills only the
    row of its head, which needs no extra process group.
    """
    params = [p for p in model.parameters() if layout_of(p).tp_replicas > 1 and p.grad is not None]
    if not params or mesh.tp == 1:
        return
    reps = layout_of(params[0]).tp_replicas
    if any(layout_of(p).tp_replicas != reps for p in params):
        raise ValueError("all replicated KV-head parameters must have the same replica count")
    grads = [p.grad for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    buf = flat.new_zeros(mesh.tp // reps, flat.numel())
    slot = mesh.tp_rank // reps
    buf[slot] = flat
    comm.all_reduce(buf, mesh.tp_group, recorder=mesh.recorder)
    for g, part in zip(grads, buf[slot].split([g.numel() for g in grads]), strict=True):
        g.copy_(part.view_as(g))


def sync_tp_grads(model: nn.Module, mesh: Mesh) -> None:
    """Make every tensor-parallel gradient complete: call once after the last backward of a step."""
    allreduce_sequence_parallel_grads(model, mesh)
    allreduce_kv_replica_grads(model, mesh)


def gather_full_tensor(t: torch.Tensor, p: nn.Parameter, mesh: Mesh,
                       sum_replicas: bool = False) -> torch.Tensor:
    """``t`` (shaped like this rank's shard of ``p``: the parameter, its gradient or optimizer state) at full
    size, following its `Layout`; copies of a replicated KV head are taken once, or summed (gradients that
    `sync_tp_grads` has not completed). Collective over tp."""
    layout = layout_of(p)
    if layout.expert and mesh.ep > 1:  # experts of the other ep ranks first, then the tp split
        t = comm.gather_along_dim(t.detach().contiguous(), layout.ep_dim, mesh.ep_group, mesh.recorder)
    dim = layout.tp_dim
    if dim is None or mesh.tp == 1:
        return t.detach().clone()
    full = comm.gather_along_dim(t.detach().contiguous(), dim, mesh.tp_group, mesh.recorder)
    reps = layout.tp_replicas
    if reps == 1:
        return full
    chunks = full.chunk(mesh.tp, dim)
    heads = [chunks[i:i + reps] for i in range(0, mesh.tp, reps)]
    return torch.cat([torch.stack(h).sum(0) if sum_replicas else h[0] for h in heads], dim)


def gather_full_params(model: nn.Module, mesh: Mesh) -> dict[str, torch.Tensor]:
    """Every parameter at full size, by name (as ``named_parameters``: a tied weight once).
    Collective over tp."""
    return {name: gather_full_tensor(p, p, mesh) for name, p in model.named_parameters()}


def gather_full_grads(model: nn.Module, mesh: Mesh, synced: bool = True) -> dict[str, torch.Tensor | None]:
    """Every gradient at full size, by name. ``synced``: `sync_tp_grads` already ran (the state the optimizer
    sees); otherwise sequence-parallel gradients are summed over tp and KV replicas summed here."""
    out: dict[str, torch.Tensor | None] = {}
    for name, p in model.named_parameters():
        g = p.grad
        if g is not None and not synced and layout_of(p).tp_partial:
            g = comm.all_reduce(g.detach().clone(), mesh.tp_group, recorder=mesh.recorder)
        # A gradient is None on all tp ranks or on none (same graph), so the collectives stay matched.
        out[name] = None if g is None else gather_full_tensor(g, p, mesh, sum_replicas=not synced)
    return out
