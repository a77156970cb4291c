"""Llama (Meta's Llama 2/3 line): RMSNorm, SwiGLU, RoPE, grouped-query attention, no biases. With
``model.moe_every`` its MLPs become Mixture-of-Experts layers (Mixtral / DeepSeek-V3 style presets); with
``model.attention=mla`` its attention is DeepSeek's multi-head latent attention (models/mla.py)."""

from __future__ import annotations

import dataclasses
import math

from megaloom.models.family import Family, Traits
from megaloom.models.llama import hf_deepseek, hf_mixtral
from megaloom.models.llama.hf import HF
from megaloom.models.llama.presets import PRESETS
from megaloom.models.plan import DECODER_PLAN


def llama_ffn_dim(d_model: int) -> int:
    """Llama's MLP width: 8/3 * d_model rounded up to a multiple of 256."""
    return 256 * math.ceil(int(8 * d_model / 3) / 256)


TRAITS = Traits(norm="rmsnorm", gated_mlp=True, bias=False, positions="rope", default_ffn_dim=llama_ffn_dim)

FAMILY = Family(name="llama", description="RMSNorm, SwiGLU, RoPE, GQA (Llama 2/3; MoE presets: Mixtral, DeepSeek-V3)",
                traits=TRAITS, dense_decoder=True, plan=DECODER_PLAN, presets=PRESETS,
                # MoE llama models are Mixtrals; with latent attention (dense or MoE) DeepSeek-V3s
                hf=dataclasses.replace(HF, moe=hf_mixtral.HF, mla=hf_deepseek.HF))
