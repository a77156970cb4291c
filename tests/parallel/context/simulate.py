"""Ring attention's per-step kernels and merge run for every virtual cp rank in ring order on one process: the
same functions the distributed ring calls, without the transfers (tests on CPU and on one GPU)."""

from __future__ import annotations

import torch

from megaloom.parallel.context.blocks import ring_step_backward, ring_step_forward
from megaloom.parallel.context.layout import natural_order, shard_sequence


def simulated_ring(q, k, v, dout, cp):
    """Every virtual rank's forward (ring order, merged) and backward (dK/dV summed per source) on one process;
    returns full-length (out, dq, dk, dv) in natural order."""
    scale = q.shape[-1] ** -0.5
    part = [[shard_sequence(x, cp, r, dim=2) for r in range(cp)] for x in (q, k, v, dout)]
    qs, ks, vs, ds = part
    outs, dqs = [], []
    dks = [torch.zeros(ks[0].shape, device=q.device) for _ in range(cp)]
    dvs = [torch.zeros(vs[0].shape, device=q.device) for _ in range(cp)]
    for r in range(cp):
        out = torch.zeros(qs[r].shape, device=q.device)
        lse = torch.full(qs[r].shape[:3], float("-inf"), device=q.device)
        for step in range(cp):
            src = (r - step) % cp
            ring_step_forward(qs[r], ks[src], vs[src], out, lse, r, src, scale)
        dq = torch.zeros(qs[r].shape, device=q.device)
        for step in range(cp):
            src = (r - step) % cp
            dk, dv = ring_step_backward(ds[r], qs[r], ks[src], vs[src], out, lse, dq, r, src, scale)
            dks[src] += dk
            dvs[src] += dv
        outs.append(out)
        dqs.append(dq)
    order = natural_order(cp, q.shape[2] // (2 * cp), q.device)
    return [torch.cat(x, dim=2).index_select(2, order) for x in (outs, dqs, dks, dvs)]
