"""Collective matmuls (``parallel.async_tp``): sequence parallelism's all-gather and reduce-scatter split into
tp ring steps, each step's transfer in flight while the previous chunk's GEMM runs.

Under sp a tensor-parallel region starts with an all-gather of the sequence shards and ends with a
reduce-scatter; done as one collective each, the GEMM that needs the gathered sequence waits for all of it,
and the reduce-scatter waits for the whole GEMM. Decomposed (Wang et al. 2022, "Overlap communication with
dependent computation via decomposition"; Megatron's tp-comm-overlap and TorchTitan's async TP do the same with
userbuffers / symmetric memory), each rank sends its chunk to the next rank of the tp ring while it multiplies
the chunk it holds:

  all-gather + matmul   step s multiplies the chunk of rank (r - s) and forwards it around the ring
                        (forward of the column-parallel linears; backward of the row-parallel one)
  matmul + reduce-scatter
                        step s computes the partial product of chunk (r - s - 1), adds the partial sum that
                        arrived from the previous rank and sends it on; after tp steps rank r holds its own
                        chunk summed over the ring (forward of the row-parallel linear; backward of the
                        column-parallel ones)

The weight gradients ride on the same rings: each chunk's contribution is added while the next chunk travels.
Nothing but the order of the sums differs from the one-collective path (parity within float32 rounding, tested).
The transfers are batched point-to-point sends and receives (`comm.send_recv`), so the same code runs over
gloo and NCCL; on GPUs NCCL runs them on its own stream beside the GEMMs. Written here rather than taken from
torch's symmetric-memory ops (`torch.distributed._symmetric_memory`): those need CUDA with NVLink symmetric
memory and cannot be run or tested on gloo, and they are reached only through the compiler's micro-pipeline
pass, which megaloom's tensor-parallel layers (plain tensors, own autograd borders) do not feed.

Used in eager mode only (``lean_path_active``): under torch.compile the one-collective path runs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.autograd import Function

from megaloom.parallel.comm import Group, OpRecorder
from megaloom.parallel.ring import Ring


def _chunk(x: torch.Tensor, index: int, n: int) -> torch.Tensor:
    return x.narrow(1, index * n, n)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


def _reduce_scatter_ring(ring: Ring, partial: Callable[[int], torch.Tensor]) -> torch.Tensor:
    """Matmul + reduce-scatter: ``partial(c)`` is this rank's addend to sequence chunk c; returns chunk r summed
    over the ring. Step s computes chunk (r - s - 1) while the previous step's sum travels."""
    incoming = None
    for s in range(ring.size):
        part = partial((ring.rank - s - 1) % ring.size)
        if incoming is not None:
            part = part + incoming()
        if s == ring.size - 1:
            return part
        incoming = ring.shift(part)
    raise AssertionError("unreachable")


class _AllGatherLinears(Function):
    """y_i = all_gather_seq(x_local) W_i^T + b_i for the column-parallel linears of one region, as ring steps;
    saves x_local only (as `sp_linear._GatheredLinears`)."""

    @staticmethod
    def forward(ctx, x_local: torch.Tensor, group: Group, recorder: OpRecorder | None, n: int,
                *params: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        ring = Ring(group, recorder)
        weights, biases = params[:n], params[n:]
        outs: list[list[torch.Tensor | None]] = [[None] * ring.size for _ in range(n)]
        cur, c = x_local, ring.rank
        for s in range(ring.size):
            nxt = ring.shift(cur) if s < ring.size - 1 else None
            for i, (w, b) in enumerate(zip(weights, biases, strict=True)):
                outs[i][c] = F.linear(cur, w, b)
            if nxt is not None:
                cur, c = nxt(), (c - 1) % ring.size
        ctx.group, ctx.recorder, ctx.n = group, recorder, n
        ctx.has_bias = [b is not None for b in biases]
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(x_local, *weights)
        return tuple(torch.cat(o, dim=1) for o in outs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        x_local, *weights = ctx.saved_tensors
        ring, n = Ring(ctx.group, ctx.recorder), ctx.n
        need_x = ctx.needs_input_grad[0]
        need_w, need_b = ctx.needs_input_grad[4:4 + n], ctx.needs_input_grad[4 + n:]
        used = [i for i, g in enumerate(grads) if g is not None]
        chunk = x_local.shape[1]
        grad_w: list[torch.Tensor | None] = [None] * n
        grad_b: list[torch.Tensor | None] = [None] * n
        # Weight gradients: x's chunks travel the ring again, each chunk's share added while the next arrives.
        if any(need_w[i] for i in used):
            cur, c = x_local, ring.rank
            for s in range(ring.size):
                nxt = ring.shift(cur) if s < ring.size - 1 else None
                for i in used:
                    if need_w[i]:
                        term = _rows(_chunk(grads[i], c, chunk)).t() @ _rows(cur)
                        grad_w[i] = term if grad_w[i] is None else grad_w[i] + term
                if nxt is not None:
                    cur, c = nxt(), (c - 1) % ring.size
        for i in used:
            if ctx.has_bias[i] and need_b[i]:
                grad_b[i] = _rows(grads[i]).sum(0)
        grad_x = None
        if need_x and used:  # sum_i g_i W_i, reduce-scattered over the sequence as ring steps
            def partial(c: int) -> torch.Tensor:
                out = None
                for i in reversed(used):  # last linear first, as autograd sums them
                    gx = _chunk(grads[i], c, chunk) @ weights[i]
                    out = gx if out is None else out + gx
                return out

            grad_x = _reduce_scatter_ring(ring, partial)
        return (grad_x, None, None, None, *grad_w, *grad_b)


class _LinearReduceScatter(Function):
    """y_local = reduce_scatter_seq(x W^T), the row-parallel linear's exit, as ring steps (no bias: it is added
    once, after the reduction)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, group: Group,
                recorder: OpRecorder | None) -> torch.Tensor:
        ring = Ring(group, recorder)
        if x.shape[1] % ring.size:
            raise ValueError(f"cannot reduce-scatter a sequence of {x.shape[1]} over {ring.size} tp ranks "
                             "(with parallel.sp the sequence length must be divisible by parallel.tp)")
        chunk = x.shape[1] // ring.size
        ctx.group, ctx.recorder = group, recorder
        ctx.save_for_backward(x, weight)
        return _reduce_scatter_ring(ring, lambda c: F.linear(_chunk(x, c, chunk), weight))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        ring = Ring(ctx.group, ctx.recorder)
        chunk = grad.shape[1]
        need_x, need_w = ctx.needs_input_grad[:2]
        grad_x_chunks: list[torch.Tensor | None] = [None] * ring.size
        grad_w = None
        cur, c = grad.contiguous(), ring.rank  # the output gradient's chunks travel the ring (all-gather)
        for s in range(ring.size):
            nxt = ring.shift(cur) if s < ring.size - 1 else None
            if need_x:
                grad_x_chunks[c] = cur @ weight
            if need_w:
                term = _rows(cur).t() @ _rows(_chunk(x, c, chunk))
                grad_w = term if grad_w is None else grad_w + term
            if nxt is not None:
                cur, c = nxt(), (c - 1) % ring.size
        grad_x = torch.cat(grad_x_chunks, dim=1) if need_x else None
        return grad_x, grad_w, None, None


def all_gather_linears(x_local: torch.Tensor, params: list[tuple[torch.Tensor, torch.Tensor | None]], group: Group,
                       recorder: OpRecorder | None = None) -> tuple[torch.Tensor, ...]:
    """The column-parallel linears ``params`` ((weight, bias), already in x_local's dtype) on the all-gathered
    sequence of ``x_local`` [B, T/tp, D], as ring steps."""
    ws = [w for w, _ in params]
    bs = [b for _, b in params]
    return _AllGatherLinears.apply(x_local, group, recorder, len(params), *ws, *bs)


def linear_reduce_scatter(x: torch.Tensor, weight: torch.Tensor, group: Group,
                          recorder: OpRecorder | None = None) -> torch.Tensor:
    """reduce_scatter_seq(x W^T) as ring steps; ``x`` [B, T, in/tp] and ``weight`` in the compute dtype."""
    return _LinearReduceScatter.apply(x, weight, group, recorder)
