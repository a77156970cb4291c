"""Qwen3 (dense): Llama's decoder (RMSNorm, SwiGLU, RoPE, grouped-query attention, no biases) with QK-norm, an
RMSNorm over each query and key head before RoPE (`model.Qwen3Attention`).

The parallel plan is the decoder's plus the QK-norm weights as `PartialGrad`: under tensor parallelism each
rank normalises only its own heads, so their gradients are partial sums over tp (with or without sp).

Shapes: Qwen3 fixes head_dim = 128, which is d_model / n_heads for 1.7B, 8B and 14B; 0.6B, 4B and 32B have wider
heads and their presets set model.head_dim (see presets.py). Every released size is a preset and imports.
"""

from __future__ import annotations

import dataclasses
import math

from megaloom.models.family import Family, Traits
from megaloom.models.plan import DECODER_PLAN
from megaloom.models.plan_styles import PartialGrad
from megaloom.models.qwen3 import hf_moe
from megaloom.models.qwen3.hf import HF
from megaloom.models.qwen3.model import Qwen3Attention
from megaloom.models.qwen3.presets import PRESETS


def qwen3_ffn_dim(d_model: int) -> int:
    """The MLP width when model.ffn_dim is 0: 3 * d_model as in Qwen3-0.6B, -1.7B and -8B (-4B, -14B and -32B
    are wider; every preset sets its own), rounded up to a multiple of 256."""
    return 256 * math.ceil(3 * d_model / 256)


TRAITS = Traits(norm="rmsnorm", gated_mlp=True, bias=False, positions="rope", default_ffn_dim=qwen3_ffn_dim,
                attention=Qwen3Attention, qk_norm=True)

PLAN = {**DECODER_PLAN, "layers.*.attn.q_norm": PartialGrad(), "layers.*.attn.k_norm": PartialGrad()}

FAMILY = Family(name="qwen3", description="Llama's decoder with QK-norm (Qwen3 dense: 0.6B to 32B shapes)",
                traits=TRAITS, dense_decoder=True, plan=PLAN, presets=PRESETS,
                hf=dataclasses.replace(HF, moe=hf_moe.HF))  # MoE qwen3 models are Qwen3-MoE
