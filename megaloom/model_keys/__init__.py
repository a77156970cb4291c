"""The model section's keys, one group per owner, and `ModelConfig` assembled from them.

Each group is a dataclass of the keys one part of megaloom/models/ reads (with their defaults and help) and, where it
needs no family, the checks of those keys: the shared decoder's (`decoder`), Gemma's soft-caps (`gemma`), latent
attention (`mla`), the experts (`moe`), multi-token prediction (`mtp`), the image encoder (`llava`), BERT's
sentence-order head (`bert`), frozen parts (`freeze`), the adapters (`lora`). They live here, beside
megaloom/config.py and not in the families' folders, because every command loads the config without torch while
megaloom/models/ and each family's package load torch when imported. The rules that need a family (its traits,
its own checks, presets, size defaults) are megaloom/models/rules.py's.

`ModelConfig` subclasses the groups: a dataclass collects its fields from the last base to the first, so the bases
are listed in reverse and the keys keep their order (`megaloom config --list` and config.yaml list them so; keys
are a contract). A new group is its module and its place in this list.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from megaloom.model_keys import decoder, llava
from megaloom.model_keys.bert import BertKeys
from megaloom.model_keys.decoder import DecoderKeys
from megaloom.model_keys.freeze import FreezeKeys
from megaloom.model_keys.gemma import GemmaKeys
from megaloom.model_keys.llava import LlavaKeys
from megaloom.model_keys.lora import LoraConfig, LoraKeys
from megaloom.model_keys.mla import MlaKeys
from megaloom.model_keys.moe import MoeKeys
from megaloom.model_keys.mtp import MtpKeys
from megaloom.model_keys.shape import (
    resolved_expert_ffn_dim,
    resolved_ffn_dim,
    resolved_head_dim,
    resolved_kv_heads,
    resolved_shape,
)

__all__ = ["LoraConfig", "ModelConfig", "check", "resolved_expert_ffn_dim", "resolved_ffn_dim", "resolved_head_dim",
           "resolved_kv_heads", "resolved_shape", "shape_keys"]


@dataclass
class ModelConfig(LoraKeys, FreezeKeys, BertKeys, LlavaKeys, MtpKeys, MoeKeys, MlaKeys, GemmaKeys, DecoderKeys):
    """The model section: every group's keys, the decoder's first (the bases in reverse: see above)."""


def check(m: ModelConfig, max_images: int, seq_len: int) -> None:
    """The model keys' checks that need no family, in validation's order: the image encoder (and model.freeze),
    then the heads."""
    llava.check(m, max_images, seq_len)
    decoder.check_heads(m)


def shape_keys() -> dict[str, bool | str]:
    """The model keys that size the weights (their fields' ``shape``), in key order: True, or the condition under
    which they do ("positions": with learned positions; "experts": in a model with experts)."""
    return {f.name: f.metadata["shape"] for f in fields(ModelConfig) if f.metadata.get("shape")}
