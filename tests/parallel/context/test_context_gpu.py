"""Ring attention's kernels on one GPU (the lead runs this on the H200): the flash per-block kernel with its
log-sum-exp, the merge and the per-block backward, every virtual cp rank in ring order, in bf16 against
full causal SDPA (one GPU cannot run the ring's transfers; tests/parallel/context/test_context_world.py covers
those on gloo). The bar: the ring's bf16 error from an fp32 reference is of the order of SDPA's own bf16 error."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from .simulate import simulated_ring

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("cp,heads,kv_heads,seq", [(2, 16, 8, 4096), (4, 32, 8, 8192), (8, 8, 8, 2048)])
def test_flash_blocks_and_merge_match_sdpa_in_bf16(cp, heads, kv_heads, seq):
    torch.manual_seed(0)
    dev = torch.device("cuda")
    b, d = 1, 128
    q32 = torch.randn(b, heads, seq, d, device=dev)
    k32, v32 = (torch.randn(b, kv_heads, seq, d, device=dev) for _ in range(2))
    dout32 = torch.randn(b, heads, seq, d, device=dev)

    def sdpa(q, k, v, dout):
        q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=heads != kv_heads)
        out.backward(dout)
        return [out.float(), q.grad.float(), k.grad.float(), v.grad.float()]

    ref = sdpa(q32, k32, v32, dout32)  # fp32 reference
    bf = [x.bfloat16() for x in (q32, k32, v32, dout32)]
    base = sdpa(*bf)  # SDPA's own bf16 error
    ring = simulated_ring(*bf, cp)  # the flash kernel path (bf16 on CUDA)
    for name, r, s, want in zip(("out", "dq", "dk", "dv"), ring, base, ref, strict=True):
        ring_err = (r.float() - want).abs().max().item()
        sdpa_err = (s - want).abs().max().item()
        scale = want.abs().max().item()
        assert ring_err <= 2 * sdpa_err + 1e-3 * scale, (name, ring_err, sdpa_err, scale)
