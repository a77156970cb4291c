"""GPT-2: LayerNorm with bias, GeLU MLP, learned positions, biases in every linear layer."""

from __future__ import annotations

from megaloom.models.family import Family, Traits
from megaloom.models.gpt2.hf import HF
from megaloom.models.gpt2.presets import PRESETS
from megaloom.models.plan import DECODER_PLAN

TRAITS = Traits(norm="layernorm", gated_mlp=False, bias=True, positions="learned", default_ffn_dim=lambda d: 4 * d)

FAMILY = Family(name="gpt2", description="LayerNorm, GeLU, learned positions, biases (GPT-2)",
                traits=TRAITS, dense_decoder=True, plan=DECODER_PLAN, presets=PRESETS, hf=HF)
