"""Tensor (+ sequence) parallelism for megaloom's Transformer, applied to a built, initialised model.

`parallelize_tensor` swaps the linear layers and the embedding for their tensor-parallel versions in place.
Each shard lives under the original parameter name (``layers.0.attn.q_proj.weight`` is this rank's rows),
and shards are copied from the already-initialised full weights, so the same seed gives the same model as
a single process. Layout per block (Megatron):

  attention: enter region once -> q/k/v column-parallel (whole heads per rank) -> SDPA on local heads ->
             o_proj row-parallel -> reduce (or reduce-scatter with sp)
  MLP:       enter region once -> gate/up column-parallel -> activation -> down_proj row-parallel -> reduce

"Enter region" is a forward pre-hook on the attention / MLP module: identity forward + all-reduce backward
(copy_to_tp), or with sequence parallelism an all-gather of the sequence shards (gather_from_seq), done once
for q, k and v together. The embedding and output head are split by vocabulary rows and the loss is the
vocab-parallel cross-entropy, so full logits never exist. With sp, the residual stream between regions holds
T/tp tokens per rank: `model.seq_scatter` splits it after the embedding, `model.seq_gather` re-assembles it
after the final norm for the column-parallel head.

When tp > n_kv_heads, each rank holds one KV head (rank r: head r // (tp / n_kv_heads)), which serves its
local query heads exactly as grouped-query attention maps them (q head h uses kv head h // (n_heads /
n_kv_heads)). The replicas' gradients are partial and are summed by `sync_tp_grads`.

After backward (and before the data-parallel reduction and clipping) call `sync_tp_grads(model, mesh)`.
"""

from __future__ import annotations

import torch
from torch import nn

from megaloom.models.moe import MoE
from megaloom.models.transformer import Transformer
from megaloom.parallel import comm
from megaloom.parallel.expert import expert_norm_sq, is_expert_param, parallelize_moe
from megaloom.parallel.mesh import Mesh, check_tp_model
from megaloom.parallel.random import ForkedCall, ForkedDropout, RNGTracker
from megaloom.parallel.tp_layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, mark
from megaloom.parallel.vocab_ce import VocabParallelLoss, gather_vocab_logits, vocab_parallel_cross_entropy

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "VocabParallelLoss",
           "allreduce_kv_replica_grads", "allreduce_sequence_parallel_grads", "gather_full_grads",
           "gather_full_params", "gather_full_tensor", "gather_vocab_logits", "parallelize_tensor",
           "sync_tp_grads", "tp_grad_norm", "vocab_parallel_cross_entropy"]


class _EnterRegion:
    """Forward pre-hook on an attention / MLP module: its first positional input enters the tp region."""

    def __init__(self, mesh: Mesh, sp: bool) -> None:
        self.mesh, self.sp = mesh, sp

    def __call__(self, module: nn.Module, args: tuple) -> tuple:
        enter = comm.gather_from_seq if self.sp else comm.copy_to_tp
        return (enter(args[0], self.mesh.tp_group, self.mesh.recorder),) + tuple(args[1:])


class _SeqScatter:
    """model.seq_scatter with sp: keep this rank's T/tp tokens of the embedded sequence."""

    def __init__(self, mesh: Mesh) -> None:
        self.mesh = mesh

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return comm.scatter_to_seq(x, self.mesh.tp_group, self.mesh.recorder)


class _SeqGather:
    """model.seq_gather with sp: re-assemble the sequence for the column-parallel head."""

    def __init__(self, mesh: Mesh) -> None:
        self.mesh = mesh

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return comm.gather_from_seq(x, self.mesh.tp_group, self.mesh.recorder)


def _mark_sequence_parallel(module: nn.Module | None) -> None:
    # Replicated weights applied to this rank's tokens only: their gradient is a partial sum over tp.
    if module is not None:
        for p in module.parameters():
            mark(p, None, sequence_parallel=True)


def parallelize_tensor(model: Transformer, mesh: Mesh, sp: bool) -> Transformer:
    """Split ``model`` over ``mesh.tp`` ranks in place (parameter names unchanged) and return it.

    Relies on the Transformer hooks ``model.loss_fn`` (set to the vocab-parallel loss) and, with ``sp``,
    ``model.seq_scatter`` / ``model.seq_gather``. tp == 1 leaves the model untouched.
    """
    if mesh.tp == 1:
        for moe in model.moe_layers:
            parallelize_moe(moe, mesh, sp)  # expert parallelism alone
        return model
    missing = [h for h in ("loss_fn", "seq_scatter", "seq_gather") if not hasattr(model, h)]
    if missing:  # without them the forward would silently compute a loss on this rank's logits only
        raise RuntimeError(f"tensor parallelism needs the Transformer hooks {', '.join(missing)}")
    if isinstance(model.tok_emb, VocabParallelEmbedding):
        raise ValueError("parallelize_tensor: this model is already tensor-parallel")
    cfg = model.cfg
    check_tp_model(cfg, mesh.tp)
    tp, n_kv = mesh.tp, cfg.n_kv_heads or cfg.n_heads
    head_dim = cfg.d_model // cfg.n_heads
    out_mode = "reduce_scatter" if sp else "reduce"
    tracker = RNGTracker.for_mesh(mesh)
    if tp > n_kv:
        kv_replicas = tp // n_kv
        kv_rows: tuple[int, int] | None = ((mesh.tp_rank // kv_replicas) * head_dim, head_dim)
    else:
        kv_replicas, kv_rows = 1, None

    for block in model.layers:
        attn, mlp = block.attn, block.mlp
        attn.q_proj = ColumnParallelLinear.from_linear(attn.q_proj, mesh, "none")
        attn.k_proj = ColumnParallelLinear.from_linear(attn.k_proj, mesh, "none", kv_rows, kv_replicas)
        attn.v_proj = ColumnParallelLinear.from_linear(attn.v_proj, mesh, "none", kv_rows, kv_replicas)
        attn.o_proj = RowParallelLinear.from_linear(attn.o_proj, mesh, out_mode)
        attn.register_forward_pre_hook(_EnterRegion(mesh, sp))
        if isinstance(mlp, MoE):
            parallelize_moe(mlp, mesh, sp)  # experts split by hidden units (and over ep), see parallel.expert
        else:
            if mlp.gated:
                mlp.gate_proj = ColumnParallelLinear.from_linear(mlp.gate_proj, mesh, "none")
            mlp.up_proj = ColumnParallelLinear.from_linear(mlp.up_proj, mesh, "none")
            mlp.down_proj = RowParallelLinear.from_linear(mlp.down_proj, mesh, out_mode)
            mlp.register_forward_pre_hook(_EnterRegion(mesh, sp))
        if sp:
            _mark_sequence_parallel(block.attn_norm)
            _mark_sequence_parallel(getattr(block, "mlp_norm", None))
        if cfg.dropout > 0:
            # Attention probabilities belong to the local heads: independent masks per tp rank.
            attn._core = ForkedCall(attn._core, tracker)
            if sp:  # the residual stream holds different tokens on each rank; without sp it is replicated
                attn.resid_dropout = ForkedDropout(cfg.dropout, tracker)
                if not isinstance(mlp, MoE):  # an MoE layer drops out on the gathered, replicated sequence
                    mlp.dropout = ForkedDropout(cfg.dropout, tracker)

    tied = model.head.weight is model.tok_emb.weight
    model.tok_emb = VocabParallelEmbedding.from_embedding(model.tok_emb, mesh, "reduce")
    if tied:
        model.head = ColumnParallelLinear(model.tok_emb.weight, None, mesh, "none" if sp else "copy")
    else:
        model.head = ColumnParallelLinear.from_linear(model.head, mesh, "none" if sp else "copy")
    model.loss_fn = VocabParallelLoss(mesh)
    if sp:
        # The embedding (with gpt2's positions) is reduced to a full, replicated sequence and then split;
        # the final norm runs on the shards and the head on the re-gathered sequence.
        model.seq_scatter = _SeqScatter(mesh)
        model.seq_gather = _SeqGather(mesh)
        _mark_sequence_parallel(model.norm)
    for p in model.parameters():
        if not hasattr(p, "_tp_dim"):
            mark(p, None)
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
    grads = [p.grad for p in model.parameters()
             if getattr(p, "_sequence_parallel", False) and p.grad is not None]
    if grads:
        _allreduce_flat(grads, mesh)


def allreduce_kv_replica_grads(model: nn.Module, mesh: Mesh) -> None:
    """Sum the gradients of replicated KV heads over the tp ranks that hold the same head.

    Done with one all-reduce over the tp group of a [tp / replicas, n] buffer where each rank fills only the
    row of its head, which needs no extra process group.
    """
    params = [p for p in model.parameters() if getattr(p, "_tp_replicas", 1) > 1 and p.grad is not None]
    if not params or mesh.tp == 1:
        return
    reps = params[0]._tp_replicas
    if any(p._tp_replicas != reps for p in params):
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


def tp_grad_norm(model: nn.Module, mesh: Mesh) -> torch.Tensor:
    """L2 norm of the full (unsharded) gradient, computed from the shards, for clipping.

    Each element of the full model counts once: a sharded gradient contributes its local squares, one held
    identically by all tp ranks contributes 1/tp of them on each, a replicated KV head 1/replicas. Summed
    over tp, then over pp (stages hold different layers). Call after `sync_tp_grads`. Not covered:
    ZeRO-sharded gradients and embeddings tied across pipeline stages, whose owners must weight them likewise.
    """
    device = next(model.parameters()).device
    total = torch.zeros((), dtype=torch.float32, device=device)
    experts = []
    for p in model.parameters():  # a tied weight is yielded once
        if p.grad is None:
            continue
        if is_expert_param(p):  # different experts on each ep rank: summed over ep first
            experts.append((p.grad, p))
            continue
        sq = p.grad.float().pow(2).sum()
        if getattr(p, "_tp_dim", None) is None:
            sq = sq / mesh.tp
        else:
            sq = sq / getattr(p, "_tp_replicas", 1)
        total += sq
    if mesh.ep > 1:
        total += expert_norm_sq(experts, mesh).to(device)
    comm.all_reduce(total, mesh.tp_group, recorder=mesh.recorder)
    comm.all_reduce(total, mesh.pp_group, recorder=mesh.recorder)
    return total.sqrt()


def gather_full_tensor(t: torch.Tensor, p: nn.Parameter, mesh: Mesh,
                       sum_replicas: bool = False) -> torch.Tensor:
    """``t`` (shaped like this rank's shard of ``p``: the parameter, its gradient or optimizer state) at full
    size, following ``p._tp_dim``; copies of a replicated KV head are taken once, or summed (gradients that
    `sync_tp_grads` has not completed). Collective over tp."""
    if is_expert_param(p) and mesh.ep > 1:  # experts of the other ep ranks first, then the tp split
        t = comm.gather_along_dim(t.detach().contiguous(), p._ep_dim, mesh.ep_group, mesh.recorder)
    dim = getattr(p, "_tp_dim", None)
    if dim is None or mesh.tp == 1:
        return t.detach().clone()
    full = comm.gather_along_dim(t.detach().contiguous(), dim, mesh.tp_group, mesh.recorder)
    reps = getattr(p, "_tp_replicas", 1)
    if reps == 1:
        return full
    chunks = full.chunk(mesh.tp, dim)
    heads = [chunks[i:i + reps] for i in range(0, mesh.tp, reps)]
    return torch.cat([torch.stack(h).sum(0) if sum_replicas else h[0] for h in heads], dim)


_gather_full = gather_full_tensor  # the name megaloom.parallel.state imports


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
        if g is not None and not synced and getattr(p, "_sequence_parallel", False):
            g = comm.all_reduce(g.detach().clone(), mesh.tp_group, recorder=mesh.recorder)
        # A gradient is None on all tp ranks or on none (same graph), so the collectives stay matched.
        out[name] = None if g is None else gather_full_tensor(g, p, mesh, sum_replicas=not synced)
    return out
