"""The ViT <-> Hugging Face CLIPVisionModel (as held inside LLaVA: ``vision_tower.``): tensor names and
config.json fields. CLIP's ``post_layernorm`` is not part of megaloom's ViT (LLaVA reads the blocks' output
before it): written as the identity on export, ignored on import.
"""

from __future__ import annotations

import torch

from megaloom.config import ModelConfig
from megaloom.models.hf_common import HFTensors, Tensors, refuse

# (megaloom name inside vision.layers.{i}., HF name inside encoder.layers.{i}.), weights and biases alike
LAYER = [("attn_norm", "layer_norm1"), ("attn.q_proj", "self_attn.q_proj"), ("attn.k_proj", "self_attn.k_proj"),
         ("attn.v_proj", "self_attn.v_proj"), ("attn.o_proj", "self_attn.out_proj"), ("mlp_norm", "layer_norm2"),
         ("mlp.up_proj", "mlp.fc1"), ("mlp.down_proj", "mlp.fc2")]
GLOBAL = [("patch_emb.weight", "embeddings.patch_embedding.weight"), ("cls", "embeddings.class_embedding"),
          ("pos_emb.weight", "embeddings.position_embedding.weight"), ("pre_norm.weight", "pre_layrnorm.weight"),
          ("pre_norm.bias", "pre_layrnorm.bias")]


def _names(m: ModelConfig):
    for ml, hf in GLOBAL:
        yield ml, hf
    for i in range(m.vision_layers):
        for ml, hf in LAYER:
            for leaf in ("weight", "bias"):
                yield f"layers.{i}.{ml}.{leaf}", f"encoder.layers.{i}.{hf}.{leaf}"


def to_hf_names(sd: Tensors, m: ModelConfig, src: str, dst: str) -> Tensors:
    """megaloom tensors under ``src`` (e.g. "vision.") -> HF names under ``dst`` (e.g. "model.vision_tower.")."""
    out = {dst + hf: sd[src + ml] for ml, hf in _names(m)}
    d = m.vision_d_model
    out[dst + "post_layernorm.weight"], out[dst + "post_layernorm.bias"] = torch.ones(d), torch.zeros(d)
    return out


def from_hf_names(hf: HFTensors, m: ModelConfig, src: str, dst: str) -> Tensors:
    """HF names under ``src`` -> megaloom names under ``dst``; blocks beyond model.vision_layers (LLaVA reads an
    earlier block's output: vision_feature_layer) and post_layernorm are unused and skipped."""
    sd = {dst + ml: hf.take(src + name) for ml, name in _names(m)}
    for name in list(hf.tensors):
        if name.startswith(src + "encoder.layers.") and int(name[len(src + "encoder.layers."):].split(".")[0]) \
                >= m.vision_layers:
            hf.ignore(name)
    for leaf in ("weight", "bias"):
        hf.ignore(src + f"post_layernorm.{leaf}")
    return sd


def to_hf_config(m: ModelConfig) -> dict:
    return {"model_type": "clip_vision_model", "hidden_size": m.vision_d_model,
            "intermediate_size": m.vision_ffn_dim or 4 * m.vision_d_model, "num_hidden_layers": m.vision_layers,
            "num_attention_heads": m.vision_heads, "num_channels": 3, "image_size": m.image_size,
            "patch_size": m.patch_size, "hidden_act": m.vision_act, "layer_norm_eps": m.vision_norm_eps,
            "attention_dropout": 0.0, "projection_dim": m.vision_d_model}


def from_hf_config(v: dict, where: str, used_layers: int) -> dict:
    """model.vision_* from a CLIPVisionConfig; ``used_layers``: the blocks LLaVA reads (vision_feature_layer)."""
    act = v.get("hidden_act", "quick_gelu")
    if act not in ("quick_gelu", "gelu"):
        refuse(where, "vision_config.hidden_act", act, "quick_gelu or gelu")
    if v.get("num_channels", 3) != 3:
        refuse(where, "vision_config.num_channels", v["num_channels"], "RGB images: 3")
    return dict(vision_layers=used_layers, vision_d_model=v["hidden_size"], vision_heads=v["num_attention_heads"],
                vision_ffn_dim=v["intermediate_size"], image_size=v["image_size"], patch_size=v["patch_size"],
                vision_act=act, vision_norm_eps=float(v.get("layer_norm_eps", 1e-5)), vision_cls=True)
