"""The memory plan, parameter counts and FLOP counter know multi-token prediction (model.mtp_depth): what its
modules save on CPU equals `mtp_activation_bytes` (the difference between a model with two depths and without),
their weight casts and parameters are counted, and the head's extra GEMMs and the modules' attention are FLOPs."""

from __future__ import annotations

import pytest
import torch

from megaloom.models import Transformer
from megaloom.observe.flops import flops_per_token, matmul_params
from megaloom.planning.memory_activations import mtp_activation_bytes
from megaloom.planning.memory_params import analytic_params, count_model_params

from .test_memory_plan import VOCAB, B, T, make_cfg, saved_bytes

pytestmark = pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight:UserWarning")
MLA = ["model.attention=mla", "model.n_kv_heads=0", "model.kv_lora_rank=16", "model.qk_nope_head_dim=8",
       "model.qk_rope_head_dim=8", "model.v_head_dim=8"]


def measure(cfg, bf16_residual: bool) -> tuple[int, int]:
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    model.residual_dtype = torch.bfloat16 if bf16_residual else None  # as train.bf16_residual=true does
    gen = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, VOCAB, (B, T), generator=gen) for _ in range(2))
    return saved_bytes(model, x, y, cfg.train.precision)


@pytest.mark.parametrize("precision,extra", [("fp32", []), ("bf16", ["train.recompute=full"]),
                                             ("bf16", [*MLA, "train.bf16_residual=true"])])
def test_mtp_saved_bytes_and_casts_are_exact(precision, extra):
    base = make_cfg("llama", precision, "none", 2, *extra)
    cfg = make_cfg("llama", precision, "none", 2, "model.mtp_depth=2", *extra)
    residual = "train.bf16_residual=true" in extra
    (m0, c0), (m2, c2) = measure(base, residual), measure(cfg, residual)
    assert m2 - m0 == sum(mtp_activation_bytes(cfg, tokens=B * T, batch=B, device="cpu").values())
    with torch.device("meta"):
        model = Transformer(cfg.model)
    counts, guess = count_model_params(model), analytic_params(cfg, [0, 1])
    assert c2 - c0 == (2 * counts.matmul_mtp if precision == "bf16" else 0)
    assert (guess.local, guess.matmul_mtp) == (counts.local, counts.matmul_mtp)


def test_mtp_flops_count_the_head_again_and_the_modules_attention():
    cfg = make_cfg("llama", "fp32", "none", 2, "model.mtp_depth=2")
    with torch.device("meta"):
        model = Transformer(cfg.model)
    head = model.head.weight.numel()
    plain = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("tok_emb")) + head  # tied head
    assert matmul_params(model) == plain + 2 * head
    m = cfg.model
    assert flops_per_token(m, 100, 64) == 600 + 12 * (m.n_layers + 2) * m.d_model * 64
