"""LLaVA <-> Hugging Face LlavaForConditionalGeneration (CLIP vision tower, 2-layer GeLU projector, Llama).

Names (transformers 5.x layout): ``model.vision_tower.*`` (`vit/hf.py`), ``model.multi_modal_projector.linear_1/2``,
``model.language_model.*`` (Llama's names under it) and ``lm_head.weight``. The 4.x layout (``vision_tower.
vision_model.*``, ``multi_modal_projector.*``, ``language_model.model.*``, ``language_model.lm_head``) is renamed
on import. ``vision_feature_layer`` -1 reads the last block, -k drops the k-1 blocks after the one LLaVA reads
(LLaVA-1.5: -2 of CLIP's 24); exported models have vision_feature_layer=-1. Refused by name: a list of feature
layers, ``vision_feature_select_strategy`` other than "default" (the class token's output is dropped), projector
activations other than gelu, a projector without biases.
"""

from __future__ import annotations

from megaloom.config import ModelConfig
from megaloom.errors import ConversionError
from megaloom.models.family import HFMapping
from megaloom.models.hf_common import HFTensors, Tensors, refuse
from megaloom.models.llama import hf as llama_hf
from megaloom.models.vit import hf as vit_hf

VISION, PROJ, TEXT = "model.vision_tower.", "model.multi_modal_projector.", "model.language_model."
PROJECTOR = [("projector.fc1", "linear_1"), ("projector.fc2", "linear_2")]
OLD_PREFIXES = [("vision_tower.vision_model.", VISION), ("vision_tower.", VISION), ("multi_modal_projector.", PROJ),
                ("language_model.model.", TEXT), ("language_model.lm_head.", "lm_head.")]


def to_hf_names(sd: Tensors, m: ModelConfig) -> Tensors:
    text = {TEXT + k.removeprefix("model."): v for k, v in llama_hf.to_hf_names(sd, m).items()}
    proj = {f"{PROJ}{hf}.{leaf}": sd[f"{ml}.{leaf}"] for ml, hf in PROJECTOR for leaf in ("weight", "bias")}
    return {**vit_hf.to_hf_names(sd, m, "vision.", VISION), **proj, **text}


class _Prefixed:
    """An HFTensors view that reads Llama's names ("model.layers...") under model.language_model."""

    def __init__(self, hf: HFTensors) -> None:
        self.hf = hf

    def take(self, name: str):
        return self.hf.take(TEXT + name.removeprefix("model."))


def from_hf_names(hf: HFTensors, m: ModelConfig) -> Tensors:
    sd = llama_hf.from_hf_names(_Prefixed(hf), m)
    sd.update({f"{ml}.{leaf}": hf.take(f"{PROJ}{name}.{leaf}")
               for ml, name in PROJECTOR for leaf in ("weight", "bias")})
    sd.update(vit_hf.from_hf_names(hf, m, VISION, "vision."))
    return sd


def normalize(tensors: Tensors) -> Tensors:
    """transformers 4.x names -> 5.x names."""
    out = {}
    for k, v in tensors.items():
        for old, new in OLD_PREFIXES:
            if k.startswith(old):
                k = new + k[len(old):]
                break
        out[k] = v
    return out


def to_hf_config(m: ModelConfig) -> dict:
    text = {**llama_hf.to_hf_config(m), "model_type": "llama", "vocab_size": m.vocab_size,
            "tie_word_embeddings": m.tie_embeddings}
    if not m.vision_cls:
        raise ConversionError("model.vision_cls=false: CLIP's vision tower always has a class token; only models with "
                         "model.vision_cls=true can be exported as LLaVA.")
    return {"text_config": text, "vision_config": vit_hf.to_hf_config(m), "image_token_index": m.image_token_id,
            "image_seq_length": (m.image_size // m.patch_size) ** 2, "projector_hidden_act": "gelu",
            "vision_feature_select_strategy": "default", "vision_feature_layer": -1,
            "multimodal_projector_bias": True}


def from_hf_config(hf: dict, where: str) -> dict:
    text, vision = hf.get("text_config") or {}, hf["vision_config"]
    if text.get("model_type", "llama") != "llama":
        refuse(where, "text_config.model_type", text.get("model_type"), "a Llama language model")
    for field in ("attention_bias", "mlp_bias"):
        if text.get(field, False):
            refuse(where, f"text_config.{field}", text[field], "Llama projections have no bias")
    layer = hf.get("vision_feature_layer", -2)
    n_vision = vision["num_hidden_layers"]
    if not isinstance(layer, int) or not -n_vision <= layer < 0:
        refuse(where, "vision_feature_layer", layer, f"one negative block index in -1..-{n_vision}")
    if hf.get("vision_feature_select_strategy", "default") != "default":
        refuse(where, "vision_feature_select_strategy", hf["vision_feature_select_strategy"],
               "'default': the class token's output is dropped")
    if hf.get("projector_hidden_act", "gelu") != "gelu":
        refuse(where, "projector_hidden_act", hf["projector_hidden_act"], "gelu")
    if not hf.get("multimodal_projector_bias", True):
        refuse(where, "multimodal_projector_bias", False, "a projector with biases")
    text = {**text, "vocab_size": text.get("vocab_size", hf.get("vocab_size"))}
    settings = llama_hf.decoder_settings(text, where)
    settings["tie_embeddings"] = bool(text.get("tie_word_embeddings", hf.get("tie_word_embeddings", False)))
    return dict(arch="llava", preset="llava-tiny", **settings, image_token_id=hf.get("image_token_index", 32000),
                **vit_hf.from_hf_config(vision, where, n_vision + 1 + layer))


HF = HFMapping(architecture="LlavaForConditionalGeneration", model_types=("llava",), to_hf_config=to_hf_config,
               from_hf_config=from_hf_config, to_hf_names=to_hf_names, from_hf_names=from_hf_names,
               normalize=normalize)
