"""The tensor-parallel region borders as functional collectives: what a compiled block traces.

`comm`'s borders (``copy_to_tp``, ``reduce_from_tp``, ``scatter_to_seq``, ``gather_from_seq``,
``reduce_scatter_to_seq``) call the in-place c10d collectives and tell a recorder about each one; torch.compile
cannot trace either, so every border used to split a compiled block into separate graphs (llama under tp + sp:
nine graphs per block forward and as many backward, each with its own guards and runtime wrappers; at tp 8 and
micro-batch 1 that host time, not the kernels, set the step time). While compiling, `comm` hands the borders to
the functions here instead: the same collectives over the same group, written with
``torch.distributed._functional_collectives`` (out-of-place ops with an explicit wait that Dynamo and
AOTAutograd put into the graph, and Inductor schedules), so a block with its borders is one forward graph and
one backward graph.

The all-to-all (Ulysses) mode of context parallelism (parallel/context/alltoall.py) exchanges heads for sequence
with `all_to_all` here under torch.compile, for the same reason. Ring attention does not come here: its
exchanges run inside one opaque custom op (parallel/context/ring.py says why).

What stays the same: the arithmetic (a sum over the same ranks; the gathered sequence in rank order) and so the
results, which the tp + sp world tests compare with the single process for compiled blocks too. What differs:
collectives inside a compiled graph are not seen by ``mesh.recorder`` (no Python runs per call there): the
watchdog names the last collective issued outside compiled code (NCCL's flight recorder,
``TORCH_NCCL_TRACE_BUFFER_SIZE``, records all of them), and a dry run counts a step's collectives in an
extra, uncompiled step (`training/dryrun.py`), which issues the same collectives in the same order.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
from torch.autograd import Function

# torch 2.13 renamed the tensor-in/tensor-out functional collectives; 2.11 has only the old names.
_all_gather = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
_reduce_scatter = getattr(funcol, "reduce_scatter_single_autograd", None) or funcol.reduce_scatter_tensor_autograd
_all_gather_plain = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor


def _wait(t: torch.Tensor) -> torch.Tensor:
    return funcol.wait_tensor(t)


class _CopyToRegion(Function):
    """Identity forward, sum over the group backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _wait(funcol.all_reduce(grad.contiguous(), "sum", ctx.group)), None


class _ReduceFromRegion(Function):
    """Sum over the group forward, identity backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        return _wait(funcol.all_reduce(x.contiguous(), "sum", group))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _ScatterToSeq(Function):
    """This rank's slice of dim 1 forward, the all-gathered gradient backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        n = x.shape[1] // group.size()
        return x.narrow(1, group.rank() * n, n).contiguous()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _wait(_all_gather_plain(grad.contiguous(), 1, ctx.group)), None


def copy_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    return _CopyToRegion.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    return _ReduceFromRegion.apply(x, group)


def scatter_to_seq(x: torch.Tensor, group) -> torch.Tensor:
    return _ScatterToSeq.apply(x, group)


def gather_from_seq(x: torch.Tensor, group, overlap: bool = False) -> torch.Tensor:
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


def reduce_scatter_to_seq(x: torch.Tensor, group, overlap: bool = False) -> torch.Tensor:
    """Sum over the group and keep this rank's slice of dim 1; the gradient all-gathered back. The rank-chunks of
    the sequence are brought to the front first: a view when the micro-batch has one row. ``overlap``: funcol's
    ``scatter_dim=1``, the form the micro-pipeline TP pass fuses with the GEMM that produces ``x``
    (``symm_mem.fused_matmul_reduce_scatter``)."""
    if overlap:
        return _reduce_scatter(x.contiguous(), "sum", 1, group)
    n, b, t = group.size(), x.shape[0], x.shape[1]
    chunks = x.view(b, n, t // n, *x.shape[2:]).movedim(1, 0).reshape(n * b, t // n, *x.shape[2:])
    return _wait(_reduce_scatter(chunks.contiguous(), "sum", 0, group)).view(b, t // n, *x.shape[2:])


class _AllToAll(Function):
    """Equal chunks of dim 0: rank i's chunk j lands as chunk i of rank j; the gradient takes the reverse route
    (the same exchange, since every chunk goes back to where it came from)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return _wait(funcol.all_to_all_single(x.contiguous(), None, None, group))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _wait(funcol.all_to_all_single(grad.contiguous(), None, None, ctx.group)), None


def all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """Differentiable all-to-all of equal chunks along dim 0 (``comm.all_to_all`` with equal splits)."""
    return _AllToAll.apply(x, group)

