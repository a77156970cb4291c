"""LLaVA (Liu et al. 2023): a ViT image encoder (`megaloom/models/vit/`), a 2-layer MLP projector and the Llama
decoder (dense, or MoE with ``model.moe_every``), image features taking the place of <image> tokens.

The decoder's traits and plan are Llama's; the plan adds the image encoder's (`vit.plan.vision_plan`: tensor
parallel inside the encoder, never sequence-split) and the merge of image features into the residual stream
(`SequenceScatter`: with sp each rank keeps its shard). The projector is replicated (its input is the encoder's
complete output on every rank; its gradients are complete because the merge all-gathers theirs under sp).
"""

from __future__ import annotations

import dataclasses

from megaloom.models.family import Family
from megaloom.models.llama import TRAITS
from megaloom.models.llava.hf import HF
from megaloom.models.llava.model import Llava
from megaloom.models.llava.presets import PRESETS
from megaloom.models.plan import DECODER_PLAN
from megaloom.models.plan_styles import SequenceScatter
from megaloom.models.vit.plan import vision_plan

PLAN = {**DECODER_PLAN, **vision_plan("vision"), "merge": SequenceScatter()}


FAMILY = Family(name="llava", description="ViT encoder + MLP projector + Llama decoder (LLaVA-1.5 style)",
                traits=dataclasses.replace(TRAITS, images=True), plan=PLAN, presets=PRESETS, hf=HF, module=Llava)
