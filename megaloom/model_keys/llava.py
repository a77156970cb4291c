"""The image encoder's keys (megaloom/models/llava/, megaloom/models/vit/): a ViT whose patch features, through a
2-layer MLP projector, take the place of the <image> tokens of the text. 0 vision layers = a text-only model (these
keys are unused); a family without the trait `images` builds no encoder. Their checks with model.freeze's parts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from megaloom.model_keys.base import _f, require

if TYPE_CHECKING:
    from megaloom.model_keys import ModelConfig


@dataclass
class LlavaKeys:
    vision_layers: int = _f(0, "ViT blocks of the image encoder (multimodal families such as llava); 0 = text only.",
                            shape=True)
    vision_d_model: int = _f(0, "Hidden size of the image encoder.", shape=True)
    vision_heads: int = _f(0, "Attention heads of the image encoder.", shape=True)
    vision_ffn_dim: int = _f(0, "MLP hidden size of the image encoder; 0 = 4 * model.vision_d_model.", shape=True)
    vision_act: str = _f("quick_gelu", "Image encoder MLP activation: quick_gelu (CLIP) or gelu.",
                         ("quick_gelu", "gelu"))
    vision_cls: bool = _f(True, "A class token before the patches (CLIP); its output is not passed to the language "
                                "model (LLaVA's 'default' feature selection).", shape=True)
    vision_norm_eps: float = _f(1e-5, "Epsilon of the image encoder's LayerNorms.")
    image_size: int = _f(224, "Side of the square images the encoder reads (pixels); images are resized to it.",
                         shape=True)
    patch_size: int = _f(14, "Side of one image patch (pixels): (image_size / patch_size)^2 tokens per image.",
                         shape=True)
    image_token_id: int = _f(-1, "Token id of <image> placeholders (each image fills (image_size/patch_size)^2 of "
                                 "them); -1 = the tokenizer's <image> token.")


def check(m: ModelConfig, max_images: int, seq_len: int) -> None:
    """The image encoder's shape fits together, one image's tokens fit a training row, and model.freeze names
    parts this model has."""
    parts = ("vision", "projector", "language")
    for part in m.freeze:
        require(part in parts, f"model.freeze: {part!r} is not one of {', '.join(parts)}.")
    if not m.vision_layers:
        require(not ({"vision", "projector"} & set(m.freeze)),
                f"model.freeze={','.join(m.freeze)}: this model has no image encoder (model.vision_layers=0).")
        return
    require(m.vision_d_model > 0 and m.vision_heads > 0 and m.vision_d_model % m.vision_heads == 0,
            f"model.vision_d_model ({m.vision_d_model}) must be a positive multiple of model.vision_heads "
            f"({m.vision_heads}).")
    require(m.patch_size > 0 and m.image_size % m.patch_size == 0,
            f"model.image_size ({m.image_size}) must be a multiple of model.patch_size ({m.patch_size}).")
    per_image = (m.image_size // m.patch_size) ** 2
    require(per_image < seq_len, f"one image is {per_image} tokens ((model.image_size / model.patch_size)^2) but "
                                 f"train.seq_len is {seq_len}; raise train.seq_len or model.patch_size.")
    require(max_images >= 1, f"data.max_images must be >= 1, got {max_images}.")
    require(len(set(m.freeze)) < 3, "model.freeze lists every part (vision, projector, language): nothing would "
                                    "train; leave at least one out.")
