"""Ring attention: keys and values travel around the cp ring while each rank attends to the block it holds.

Forward, on cp rank r of N: the local queries stay; the local (k, v) block is sent to rank r+1 and the block of
rank r-1 received, N-1 times, so at step i rank r holds the block of rank r-i. The transfer for step i+1 is
posted (batched isend/irecv, `comm.send_recv(wait=False)`, seen by the collective recorder and watchdog) before
step i's attention is computed, so communication hides behind computation when the block is large enough.
Each step's partial result is merged by log-sum-exp (blocks.py).

Backward recomputes each block from the saved inputs and the final (out, lse): the (k, v) blocks make the same
trip again, and the gradients dK/dV of a block travel one step behind it, each rank adding its share, until
after N exchanges they reach the block's owner. Saved for backward: q, k, v, out and lse, as a flash kernel
saves them; no score matrix is kept.

Under torch.compile (a compiled block, train.compile) the ring runs as one opaque custom op,
``megaloom::ring_attention`` (with ``megaloom::ring_attention_backward`` as its gradient), so that the block
stays one forward and one backward graph: dynamo cannot trace c10d's isend/irecv, and the eager ring used to
split every compiled block into several graphs, with host overhead and point-to-point waits between them. The
op's body is this module's eager ring (the same transfers posted before each step and waited on after it, so
the same overlap; the recorder told of each, so the watchdog sees them); the compiler sees one node with a shape
function, and saves its inputs and (out, lse) for the backward op: q, k, v, out and lse, as in eager.

The ways not taken, tried or weighed: (a) the transfers as functional collectives (an all-to-all with one
non-empty chunk: a permutation) traced step by step in an autograd.Function. The graph traces, but AOTAutograd
then owns the backward's schedule: the backward's key/value transfers depend on no gradient, so the partitioner
moves them into the forward graph, and its common-subexpression elimination merges them with the forward's
(and the backward's recomputed scores with the forward's), keeping every received block saved (cp x the
key/value memory, the ring's point lost); with the rank-dependent steps of the load-balanced split, ranks then
issued different collectives, and the world deadlocked (CPU, torch 2.13). (a') an all-gather of every rank's
k, v: traceable, but cp x the key/value block held at once and a reduce-scatter of cp x its gradient. (b) only
the exchange as a custom op, the attention math compiled: the same partitioner moves apply to the backward's
exchange op. Dynamo's own p2p tracing (``TORCHDYNAMO_ENABLE_P2P_COMPILATION``, torch 2.13) is experimental and
not in torch 2.11. What the op costs: the merge's elementwise kernels run unfused (a few per step, next to the
attention kernels), and the op's Python runs on every call (as the eager ring's does).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.autograd import Function

from megaloom.parallel import comm
from megaloom.parallel.comm import OpRecorder
from megaloom.parallel.context.blocks import ring_step_backward, ring_step_forward
from megaloom.parallel.ring import Ring, wait


def _attention_output(q: torch.Tensor) -> torch.Tensor:
    """An empty tensor of q's shape [B, H, T, D] and dtype, laid out as [B, T, H, D], as the flash kernels write
    their output: the layer's ``transpose(1, 2).reshape`` into o_proj is then a view, and what o_proj saves is
    the tensor that ring attention saves (one copy, not two)."""
    b, h, t, d = q.shape
    return q.new_empty((b, t, h, d)).transpose(1, 2)


def _ring_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, recorder,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out in q's dtype, lse fp32 [B, H, T/cp]) of this rank's queries over every rank's keys and values."""
    # The blocks choose their own precision (fp32 math, or the flash kernel on bf16/fp16 inputs): autocast would
    # turn the fp32 matmuls and the merge back into bf16.
    with torch.autocast(q.device.type, enabled=False):
        ring = Ring(group, recorder)
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
        cur_k, cur_v = k, v
        for step in range(ring.size):
            pending = ring.pass_on([cur_k, cur_v]) if step < ring.size - 1 else None
            ring_step_forward(q, cur_k, cur_v, out, lse, ring.rank, (ring.rank - step) % ring.size, scale)
            if pending is not None:
                (cur_k, cur_v), works = pending
                wait(works)
        return _attention_output(q).copy_(out), lse


def _ring_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, group, recorder,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) in the inputs' dtypes, from the final (out, lse) of `_ring_forward`."""
    with torch.autocast(q.device.type, enabled=False):
        ring = Ring(group, recorder)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        cur_k, cur_v = k, v
        acc_wait: tuple[list[torch.Tensor], list] | None = None  # dK/dV of the block we hold, from rank r-1
        for step in range(ring.size):
            pending = ring.pass_on([cur_k, cur_v]) if step < ring.size - 1 else None
            dk, dv = ring_step_backward(dout, q, cur_k, cur_v, out, lse, dq, ring.rank,
                                        (ring.rank - step) % ring.size, scale)
            if acc_wait is not None:
                (dk_in, dv_in), works = acc_wait
                wait(works)
                dk, dv = dk + dk_in, dv + dv_in
            acc_wait = ring.pass_on([dk, dv])  # after the last step this lands on the block's owner
            if pending is not None:
                (cur_k, cur_v), works = pending
                wait(works)
        (dk, dv), works = acc_wait
        wait(works)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class RingAttention(Function):
    """The eager ring (module doc)."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, recorder, scale: float):
        out, lse = _ring_forward(q, k, v, group, recorder, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.recorder, ctx.scale = group, recorder, scale
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        return *_ring_backward(dout, q, k, v, out, lse, ctx.group, ctx.recorder, ctx.scale), None, None, None


# ------------------------------------------------------------------------- under torch.compile: one opaque op

# Recorders of the cp groups, by group name (a custom op takes strings, not objects): `register_recorder`.
_RECORDERS: dict[str, Callable[[], OpRecorder | None]] = {}


def register_recorder(group, recorder: Callable[[], OpRecorder | None]) -> None:
    """``recorder()``: the recorder that the compiled ring's transfers over ``group`` report to, read at each call
    (a mesh's, which a dry run or a watchdog replaces after the model is built). Called eagerly, at set-up."""
    _RECORDERS[group.group_name] = recorder


def _group_and_recorder(group_name: str):
    group = dist.distributed_c10d._resolve_process_group(group_name)
    recorder = _RECORDERS.get(group_name)
    return group, recorder() if recorder is not None else None


# (explicit schemas: nothing read from the annotations, which `from __future__ import annotations` makes strings)
@torch.library.custom_op("megaloom::ring_attention", mutates_args=(),
                         schema="(Tensor q, Tensor k, Tensor v, str group_name, float scale) -> (Tensor, Tensor)")
def _ring_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group_name: str,
                       scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _ring_forward(q, k, v, *_group_and_recorder(group_name), scale)


@_ring_attention_op.register_fake
def _(q, k, v, group_name, scale):
    return _attention_output(q), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("megaloom::ring_attention_backward", mutates_args=(),
                         schema="(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, str group_name, "
                                "float scale) -> (Tensor, Tensor, Tensor)")
def _ring_attention_backward_op(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                out: torch.Tensor, lse: torch.Tensor, group_name: str,
                                scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _ring_backward(dout, q, k, v, out, lse, *_group_and_recorder(group_name), scale)


@_ring_attention_backward_op.register_fake
def _(dout, q, k, v, out, lse, group_name, scale):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, group_name, scale = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.group_name, ctx.scale = group_name, scale


def _backward(ctx, dout: torch.Tensor, _dlse: torch.Tensor):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = _ring_attention_backward_op(dout, q, k, v, out, lse, ctx.group_name, ctx.scale)
    return dq, dk, dv, None, None


_ring_attention_op.register_autograd(_backward, setup_context=_setup_context)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, recorder=None,
                   scale: float | None = None, group_name: str | None = None) -> torch.Tensor:
    """Causal attention of this cp rank's queries q [B, H, T/cp, D] over the whole sequence, whose keys and
    values k, v [B, Hkv, T/cp, D] are spread over ``group`` in the load-balanced split (layout.py). Returns
    [B, H, T/cp, D] in q's dtype: what full causal SDPA gives for these rows. ``group_name``: the group's name,
    read eagerly by the caller (`ContextAttention`), so that compiled code need not read it off the group.

    Document masks (packed samples) will enter here as per-token document ids that travel with the key/value
    blocks; the per-step kernels (blocks.py) then take a mask instead of the plain causal / unmasked cases."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if comm.group_size(group) == 1:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                                enable_gqa=q.shape[1] != k.shape[1])
    if torch.compiler.is_compiling():  # one node of the compiled block's graph (module doc)
        return _ring_attention_op(q, k, v, group_name or group.group_name, scale)[0]
    return RingAttention.apply(q, k, v, group, recorder, scale)
