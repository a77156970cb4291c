"""The differentiable collectives: the borders of tensor-parallel regions and the all-to-all exchanges, one set.

Each border is one function here, written once, that picks its form where it runs:

- eager: the in-place c10d collectives of `comm` (the one place that issues them eagerly), each reported to the
  mesh's recorder (the watchdog names the collective a hung rank is stuck in; a dry run tallies calls and bytes);
- traced (while torch.compile traces a block): the same collectives over the same group, written with
  ``torch.distributed._functional_collectives`` (out-of-place ops with an explicit wait that Dynamo and
  AOTAutograd put into the graph, and Inductor schedules), so a block with its borders is one forward graph and one
  backward graph. The in-place ops and the recorder's bookkeeping would split a compiled block at every border
  (llama under tp + sp: nine graphs per block forward and as many backward, each with its own guards and runtime
  wrappers; at tp 8 and micro-batch 1 that host time, not the kernels, set the step time).

What stays the same between the forms: the arithmetic (a sum over the same ranks; the gathered sequence in rank
order) and so the results, which the tp + sp world tests compare with the single process for compiled blocks too.
What differs: collectives inside a compiled graph are not seen by ``mesh.recorder`` (no Python runs per call
there): the watchdog names the last collective issued outside compiled code (NCCL's flight recorder,
``TORCH_NCCL_TRACE_BUFFER_SIZE``, records all of them), and a dry run counts a step's collectives in an extra,
uncompiled step (`training/dryrun.py`), which issues the same collectives in the same order.

All sequence-parallel borders split activations [B, T, D] along the sequence dimension 1. The all-to-all of
equal chunks (`all_to_all_equal`: the Ulysses mode of context parallelism, parallel/context/alltoall.py) has both
forms; the variable-size one (`all_to_all`: expert dispatch) and `gather_from_seq_replicated` run eager. Ring
attention does not come here: its exchanges run inside one opaque custom op (parallel/context/ring.py says why).
A group of None or of one rank makes every border the identity.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
from torch.autograd import Function

from megaloom.parallel import comm
from megaloom.parallel.comm import Group, OpRecorder

# torch 2.13 renamed the tensor-in/tensor-out functional collectives; 2.11 has only the old names.
_all_gather = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
_reduce_scatter = getattr(funcol, "reduce_scatter_single_autograd", None) or funcol.reduce_scatter_tensor_autograd
_all_gather_plain = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor


def _wait(t: torch.Tensor) -> torch.Tensor:
    return funcol.wait_tensor(t)


# ------------------------------------------------------------- entering a region: identity forward, sum backward


class _EagerCopyToRegion(Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group, recorder: OpRecorder | None) -> torch.Tensor:
        ctx.group, ctx.recorder = group, recorder
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # Every rank computed a partial gradient from its own shard of the next layer; sum them. Clone first:
        # autograd may hand the same gradient tensor to other branches (the residual path).
        grad = grad.clone(memory_format=torch.contiguous_format)
        return comm.all_reduce(grad, ctx.group, recorder=ctx.recorder), None, None


class _TracedCopyToRegion(Function):
    """Identity forward, sum over the group backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _wait(funcol.all_reduce(grad.contiguous(), "sum", ctx.group)), None


def copy_to_tp(x: torch.Tensor, group: Group, recorder: OpRecorder | None = None) -> torch.Tensor:
    """Enter a tensor-parallel region with a replicated input: identity forward, all-reduce backward."""
    if comm.group_size(group) == 1:
        return x
    if torch.compiler.is_compiling():  # one graph per compiled block: the traced form
        return _TracedCopyToRegion.apply(x, group)
    return _EagerCopyToRegion.apply(x, group, recorder)


# -------------------------------------------------------------- leaving a region: sum forward, identity backward


class _EagerReduceFromRegion(Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group, recorder: OpRecorder | None) -> torch.Tensor:
        # In place on a fresh activation (a GEMM output nobody saved); mark_dirty keeps autograd informed.
        ctx.mark_dirty(x)
        return comm.all_reduce(x, group, recorder=recorder)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None, None


class _TracedReduceFromRegion(Function):
    """Sum over the group forward, identity backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        return _wait(funcol.all_reduce(x.contiguous(), "sum", group))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def reduce_from_tp(x: torch.Tensor, group: Group, recorder: OpRecorder | None = None) -> torch.Tensor:
    """Leave a region with partial sums: all-reduce forward (in place on ``x``), identity backward."""
    if comm.group_size(group) == 1:
        return x
    if torch.compiler.is_compiling():  # one graph per compiled block: the traced form
        return _TracedReduceFromRegion.apply(x, group)
    return _EagerReduceFromRegion.apply(x, group, recorder)


# ------------------------------------------ into sequence shards: this rank's slice forward, all-gather backward


class _EagerScatterToSeq(Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group, recorder: OpRecorder | None) -> torch.Tensor:
        ctx.group, ctx.recorder = group, recorder
        return comm.split_along_dim(x, 1, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return comm.gather_along_dim(grad, 1, ctx.group, ctx.recorder), None, None


class _TracedScatterToSeq(Function):
    """This rank's slice of dim 1 forward, the all-gathered gradient backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        n = x.shape[1] // group.size()
        return x.narrow(1, group.rank() * n, n).contiguous()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _wait(_all_gather_plain(grad.contiguous(), 1, ctx.group)), None


def scatter_to_seq(x: torch.Tensor, group: Group, recorder: OpRecorder | None = None) -> torch.Tensor:
    """Keep this rank's T/tp slice of [B, T, ...] forward; all-gather the gradient backward."""
    if comm.group_size(group) == 1:
        return x
    if torch.compiler.is_compiling():  # one graph per compiled block: the traced form
        return _TracedScatterToSeq.apply(x, group)
    return _EagerScatterToSeq.apply(x, group, recorder)


# ------------------------------------ entering from sequence shards: all-gather forward, reduce-scatter backward


class _EagerGatherFromSeq(Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group, recorder: OpRecorder | None) -> torch.Tensor:
        ctx.group, ctx.recorder = group, recorder
        return comm.gather_along_dim(x, 1, group, recorder)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # The gathered sequence feeds a column-parallel layer: each rank holds a partial gradient for the
        # whole sequence, so sum them and keep our slice (Megatron's reduce-scatter, not a plain split).
        return comm.reduce_scatter_along_dim(grad, 1, ctx.group, ctx.recorder), None, None


def _traced_gather_from_seq(x: torch.Tensor, group, overlap: bool = False) -> torch.Tensor:
    """All-gather along the sequence (dim 1) forward; the gradient reduce-scattered back (funcol's autograd op).
    Gathered along dim 0, then moved into place: a view when the micro-batch has one row (the large-scale case;
    funcol's own ``gather_dim=1`` always copies).

    ``overlap`` (the compiled tp overlap, `parallel.async_tp`): in the forms Inductor's micro-pipeline TP pass
    (``torch/_inductor/fx_passes/micro_pipeline_tp.py``) recognises and fuses with the GEMMs that read the result
    (``symm_mem.fused_all_gather_matmul``): with one row, the dim-0 gather as above (the column-parallel linears
    then read it rank-major, `tp_layers.rank_major`); with more, funcol's ``gather_dim=1`` (its split + cat),
    not waited again (a second wait between the gather and its GEMM hides the pattern)."""
    n, b, t = group.size(), x.shape[0], x.shape[1]
    if overlap:
        if b > 1:
            return _all_gather(x.contiguous(), 1, group)
        return _all_gather(x.contiguous(), 0, group).view(1, n * t, *x.shape[2:])  # [n, t, ...] is [1, n t, ...]
    y = _wait(_all_gather(x.contiguous(), 0, group))  # [n * b, t, ...], rank-major
    return y.view(n, b, t, *x.shape[2:]).movedim(0, 1).reshape(b, n * t, *x.shape[2:])


def gather_from_seq(x: torch.Tensor, group: Group, recorder: OpRecorder | None = None,
                    overlap: bool = False) -> torch.Tensor:
    """Enter a region from sequence shards: all-gather along T forward, reduce-scatter backward. ``overlap``:
    compiled, in the form Inductor's micro-pipeline TP pass fuses with the GEMMs (the traced form)."""
    if comm.group_size(group) == 1:
        return x
    if torch.compiler.is_compiling():  # one graph per compiled block: the traced form
        return _traced_gather_from_seq(x, group, overlap)
    return _EagerGatherFromSeq.apply(x, group, recorder)


# ------------------------------------- leaving into sequence shards: reduce-scatter forward, all-gather backward


class _EagerReduceScatterToSeq(Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group, recorder: OpRecorder | None) -> torch.Tensor:
        ctx.group, ctx.recorder = group, recorder
        return comm.reduce_scatter_along_dim(x, 1, group, recorder)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return comm.gather_along_dim(grad, 1, ctx.group, ctx.recorder), None, None


def _traced_reduce_scatter_to_seq(x: torch.Tensor, group, overlap: bool = False) -> torch.Tensor:
    """Sum over the group and keep this rank's slice of dim 1; the gradient all-gathered back. The rank-chunks of
    the sequence are brought to the front first: a view when the micro-batch has one row. ``overlap``: funcol's
    ``scatter_dim=1``, the form the micro-pipeline TP pass fuses with the GEMM that produces ``x``
    (``symm_mem.fused_matmul_reduce_scatter``)."""
    if overlap:
        return _reduce_scatter(x.contiguous(), "sum", 1, group)
    n, b, t = group.size(), x.shape[0], x.shape[1]
    chunks = x.view(b, n, t // n, *x.shape[2:]).movedim(1, 0).reshape(n * b, t // n, *x.shape[2:])
    return _wait(_reduce_scatter(chunks.contiguous(), "sum", 0, group)).view(b, t // n, *x.shape[2:])


def reduce_scatter_to_seq(x: torch.Tensor, group: Group, recorder: OpRecorder | None = None,
                          overlap: bool = False) -> torch.Tensor:
    """Leave a region into sequence shards: reduce-scatter along T forward, all-gather backward. ``overlap``: as
    `gather_from_seq`'s."""
    if comm.group_size(group) == 1:
        return x
    if torch.compiler.is_compiling():  # one graph per compiled block: the traced form
        return _traced_reduce_scatter_to_seq(x, group, overlap)
    return _EagerReduceScatterToSeq.apply(x, group, recorder)


# ------------------------------------------------------------------------------------------ all-to-all exchanges


class _EagerAllToAll(Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Group,
                recorder: OpRecorder | None) -> torch.Tensor:
        ctx.splits, ctx.group, ctx.recorder = (out_splits, in_splits), group, recorder
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        return comm.all_to_all_single(out, x, group, out_splits, in_splits, recorder)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # The gradient travels the reverse route: what a rank received, it sends back to its source.
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits),) + tuple(grad.shape[1:]))
        comm.all_to_all_single(back, grad.contiguous(), ctx.group, in_splits, out_splits, ctx.recorder)
        return back, None, None, None, None


def all_to_all(x: torch.Tensor, group: Group, output_split_sizes: list[int], input_split_sizes: list[int],
               recorder: OpRecorder | None = None) -> torch.Tensor:
    """Differentiable variable-size all-to-all along dim 0 (expert dispatch): ``input_split_sizes[j]`` rows go
    to rank j, ``output_split_sizes[i]`` rows arrive from rank i, in rank order."""
    if comm.group_size(group) == 1:
        return x
    return _EagerAllToAll.apply(x, list(output_split_sizes), list(input_split_sizes), group, recorder)


class _TracedAllToAll(Function):
    """Equal chunks of dim 0: rank i's chunk j lands as chunk i of rank j; the gradient takes the reverse route
    (the same exchange, since every chunk goes back to where it came from)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return _wait(funcol.all_to_all_single(x.contiguous(), None, None, group))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _wait(funcol.all_to_all_single(grad.contiguous(), None, None, ctx.group)), None


def all_to_all_equal(x: torch.Tensor, group: Group, chunk: int, recorder: OpRecorder | None = None) -> torch.Tensor:
    """Differentiable all-to-all of equal chunks of ``chunk`` rows along dim 0 (`all_to_all` with equal splits;
    gradients take the way back): rank i's chunk j lands as chunk i of rank j."""
    if torch.compiler.is_compiling():  # one graph per compiled block: the traced form
        return _TracedAllToAll.apply(x, group)
    cp = comm.group_size(group)
    return all_to_all(x, group, [chunk] * cp, [chunk] * cp, recorder)


# ------------------------------------------------------------------- a gather the ranks then process identically


class _EagerGatherSplitGrad(Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group, recorder: OpRecorder | None) -> torch.Tensor:
        ctx.group = group
        return comm.gather_along_dim(x, 1, group, recorder)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # Every rank holds the complete (identical) gradient of the gathered sequence: keep our slice.
        return comm.split_along_dim(grad, 1, ctx.group), None, None


def gather_from_seq_replicated(x: torch.Tensor, group: Group, recorder: OpRecorder | None = None) -> torch.Tensor:
    """All-gather sequence shards into a sequence that the ranks then process identically (an MoE layer's
    router and dispatch under sequence parallelism): backward keeps this rank's slice instead of summing."""
    return x if comm.group_size(group) == 1 else _EagerGatherSplitGrad.apply(x, group, recorder)
