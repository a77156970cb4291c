"""Context parallelism on one process: the load-balanced split, and ring attention's per-step kernels and merge
run for every virtual cp rank in ring order, against full causal attention (forward and backward, float32)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megaloom.parallel.context.layout import local_positions, natural_order, shard_sequence

from .simulate import simulated_ring


def test_split_holds_mirrored_chunks_and_natural_order_inverts_it():
    t = torch.arange(16)[None]
    assert shard_sequence(t, 2, 0).tolist() == [[0, 1, 2, 3, 12, 13, 14, 15]]
    assert shard_sequence(t, 2, 1).tolist() == [[4, 5, 6, 7, 8, 9, 10, 11]]
    for cp in (2, 4):
        parts = [shard_sequence(t, cp, r) for r in range(cp)]
        assert all(torch.equal(p[0], local_positions(16 // cp, cp, r)) for r, p in enumerate(parts))
        gathered = torch.cat(parts, dim=1)
        assert torch.equal(gathered.index_select(1, natural_order(cp, 16 // (2 * cp))), t)
    with pytest.raises(ValueError, match="2 \\* parallel.cp"):
        shard_sequence(torch.arange(10)[None], 2, 0)


@pytest.mark.parametrize("cp,heads,kv_heads", [(1, 4, 4), (2, 4, 2), (3, 2, 1), (4, 4, 4)])
def test_ring_steps_and_merge_equal_full_causal_attention(cp, heads, kv_heads):
    torch.manual_seed(cp)
    b, t, d = 2, 8 * 2 * cp, 16
    q = torch.randn(b, heads, t, d, requires_grad=True)
    k = torch.randn(b, kv_heads, t, d, requires_grad=True)
    v = torch.randn(b, kv_heads, t, d, requires_grad=True)
    dout = torch.randn(b, heads, t, d)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=heads != kv_heads)
    ref.backward(dout)
    out, dq, dk, dv = simulated_ring(q.detach(), k.detach(), v.detach(), dout, cp)
    for got, want in ((out, ref), (dq, q.grad), (dk, k.grad), (dv, v.grad)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
