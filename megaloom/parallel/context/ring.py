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
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.autograd import Function

from megaloom.parallel import comm
from megaloom.parallel.context.blocks import ring_step_backward, ring_step_forward


class _Ring:
    """This rank's neighbours in the cp group and one non-blocking exchange with them."""

    def __init__(self, group, recorder) -> None:
        ranks = dist.get_process_group_ranks(group)
        self.size, self.rank = len(ranks), dist.get_rank(group)
        self.next, self.prev = ranks[(self.rank + 1) % self.size], ranks[(self.rank - 1) % self.size]
        self.group, self.recorder = group, recorder

    def pass_on(self, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], list]:
        """Send ``tensors`` to the next rank, receive the previous rank's into new buffers; returns (buffers,
        works to wait on)."""
        tensors = [t.contiguous() for t in tensors]  # q/k/v arrive as transposed views
        bufs = [torch.empty_like(t) for t in tensors]
        works = comm.send_recv([(t, self.next) for t in tensors], [(b, self.prev) for b in bufs],
                               self.group, self.recorder, wait=False)
        return bufs, works


def _wait(works: list) -> None:
    for w in works:
        w.wait()


class RingAttention(Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, recorder, scale: float):
        # The blocks choose their own precision (fp32 math, or the flash kernel on bf16/fp16 inputs): autocast
        # would turn the fp32 matmuls and the merge back into bf16.
        with torch.autocast(q.device.type, enabled=False):
            return RingAttention._forward(ctx, q, k, v, group, recorder, scale)

    @staticmethod
    def _forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, recorder, scale: float):
        ring = _Ring(group, recorder)
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
        cur_k, cur_v = k, v
        for step in range(ring.size):
            pending = ring.pass_on([cur_k, cur_v]) if step < ring.size - 1 else None
            ring_step_forward(q, cur_k, cur_v, out, lse, ring.rank, (ring.rank - step) % ring.size, scale)
            if pending is not None:
                (cur_k, cur_v), works = pending
                _wait(works)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.recorder, ctx.scale = group, recorder, scale
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        ring = _Ring(ctx.group, ctx.recorder)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        cur_k, cur_v = k, v
        acc_wait: tuple[list[torch.Tensor], list] | None = None  # dK/dV of the block we hold, from rank r-1
        for step in range(ring.size):
            pending = ring.pass_on([cur_k, cur_v]) if step < ring.size - 1 else None
            dk, dv = ring_step_backward(dout, q, cur_k, cur_v, out, lse, dq, ring.rank,
                                        (ring.rank - step) % ring.size, ctx.scale)
            if acc_wait is not None:
                (dk_in, dv_in), works = acc_wait
                _wait(works)
                dk, dv = dk + dk_in, dv + dv_in
            acc_wait = ring.pass_on([dk, dv])  # after the last step this lands on the block's owner
            if pending is not None:
                (cur_k, cur_v), works = pending
                _wait(works)
        (dk, dv), works = acc_wait
        _wait(works)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, recorder=None,
                   scale: float | None = None) -> torch.Tensor:
    """Causal attention of this cp rank's queries q [B, H, T/cp, D] over the whole sequence, whose keys and
    values k, v [B, Hkv, T/cp, D] are spread over ``group`` in the load-balanced split (layout.py). Returns
    [B, H, T/cp, D] in q's dtype: what full causal SDPA gives for these rows.

    Document masks (packed samples) will enter here as per-token document ids that travel with the key/value
    blocks; the per-step kernels (blocks.py) then take a mask instead of the plain causal / unmasked cases."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if comm.group_size(group) == 1:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                                enable_gqa=q.shape[1] != k.shape[1])
    return RingAttention.apply(q, k, v, group, recorder, scale)
