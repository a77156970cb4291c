"""An MoE layer's step on CUDA reads nothing back to the host: a sync per layer stalls the device (each one
drains the queue the host had launched ahead) and splits the compiled graph."""

from __future__ import annotations

import pytest
import torch

from megaloom.models.moe import MoE

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("aux_free", [0.0, 1e-3])
def test_dropless_moe_forward_and_backward_make_no_host_sync(aux_free: float) -> None:
    torch.manual_seed(0)
    layer = MoE(d_model=64, n_experts=8, top_k=2, expert_ffn_dim=128, aux_loss_weight=0.01,
                aux_free_bias_rate=aux_free).cuda()
    x = torch.randn(4, 32, 64, device="cuda", requires_grad=True)

    def step() -> None:  # bf16 autocast, as training runs it: the grouped GEMM path (the fp32 loop syncs)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = layer(x)
        out.float().sum().backward()

    step()  # first call: lazy initialisation (cuBLAS handles, ...) may sync
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(x.grad).all()
