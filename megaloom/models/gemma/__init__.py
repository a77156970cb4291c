"""Gemma (Gemma 2's decoder): the shared decoder's attention with heads of model.head_dim (256 in the released
shapes), sandwich (1 + w) RMSNorms around attention and MLP, a tanh-GeGLU MLP, the embedding scaled by
sqrt(d_model), even layers attending within model.sliding_window tokens, odd layers globally, and Gemma 2's
attention-logit and final-logit soft-capping (model.attn_softcap / final_softcap) (`model.GemmaModel`).

The parallel plan is the decoder's plus the post-norms, which like the pre-norms sit on the residual stream: with
sp they see this rank's tokens, so their gradients are partial sums over tp (`SequenceParallel`).
"""

from __future__ import annotations

from megaloom.errors import ConfigError
from megaloom.models.family import Family, Traits
from megaloom.models.gemma.hf import HF
from megaloom.models.gemma.model import GemmaModel
from megaloom.models.gemma.presets import PRESETS
from megaloom.models.plan import DECODER_PLAN
from megaloom.models.plan_styles import SequenceParallel

# What the rest of megaloom reads (the memory plan, an estimate for this module; the FLOP count reads the module):
# RMSNorm, a gated MLP, no biases, rotary positions. The MLP width when model.ffn_dim is 0: 4 d_model (2B, 9B).
TRAITS = Traits(norm="rmsnorm", gated_mlp=True, bias=False, positions="rope", default_ffn_dim=lambda d: 4 * d,
                softcap=True, query_scale=True)

PLAN = {**DECODER_PLAN, "layers.*.post_attn_norm": SequenceParallel(), "layers.*.post_mlp_norm": SequenceParallel()}


def validate(m) -> None:
    """What GemmaModel does not build: the parallel block, MoE layers."""
    for key, value, ok, why in (
            ("model.parallel_block", m.parallel_block, False, "Gemma's blocks are sequential (sandwich norms)"),
            ("model.moe_every", m.moe_every, 0, "no MoE Gemma is built")):
        if value != ok:
            raise ConfigError(f"{key}={value} with model.arch=gemma: {why}; set it to {str(ok).lower()}.")


FAMILY = Family(name="gemma", description="Gemma 2: sandwich (1+w) RMSNorms, GeGLU, scaled embeddings, "
                                          "alternating sliding-window layers, wide heads",
                traits=TRAITS, plan=PLAN, presets=PRESETS, hf=HF, validate=validate, module=GemmaModel)
