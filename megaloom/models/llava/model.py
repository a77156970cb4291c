"""LLaVA: a ViT image encoder, a 2-layer MLP projector, and megaloom's decoder, whose token embeddings at the
<image> positions are replaced by the projected patch features (several images per row, interleaved with text).

`Llava` is the shared decoder (`transformer.Transformer`) with three more submodules, ``vision`` (a
`vit.model.VisionTransformer`), ``projector`` and ``merge``; everything the decoder has keeps its name, so the
decoder's parallel plan, recomputation, fp8, checkpoints and generation apply unchanged, and a text-only batch
runs exactly as the text model does. The images of a forward come as keyword arguments:

    images   [B, K, 3, H, W] normalised pixels, K = data.max_images slots per row (or [N, 3, H, W]: all used)
    n_images [B]             slots of each row in use; row b's images fill its <image> tokens in order

Each image fills (image_size / patch_size)^2 consecutive <image> tokens (the class token's output is dropped:
LLaVA's "default" feature selection), as transformers' LlavaForConditionalGeneration expects its input ids.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megaloom.config import ModelConfig
from megaloom.models.init import InitRule
from megaloom.models.transformer import Transformer
from megaloom.models.vit.model import VisionTransformer


class Projector(nn.Module):
    """Vision features -> the language model's width: Linear, GeLU, Linear (LLaVA-1.5's mlp2x_gelu)."""

    def __init__(self, d_vision: int, d_model: int):
        super().__init__()
        self.fc1 = nn.Linear(d_vision, d_model)
        self.fc2 = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class ImageMerge(nn.Module):
    """Writes image features into the embedded tokens at the <image> positions. Holds no parameters; under
    sequence parallelism the plan sets ``split`` (models.plan_styles.SequenceScatter) and the features enter the
    rank's sequence shard only."""

    def __init__(self, image_token_id: int):
        super().__init__()
        self.image_token_id = image_token_id
        self.split = None

    def forward(self, x: torch.Tensor, tokens: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        is_image = tokens == self.image_token_id  # [B, T], full sequence on every tp rank
        if features.device.type == "cpu" and int(is_image.sum()) != features.shape[0]:
            raise ValueError(f"{int(is_image.sum())} <image> tokens (model.image_token_id={self.image_token_id}) "
                             f"but the images give {features.shape[0]} feature rows: each image needs exactly "
                             "(model.image_size / model.patch_size)^2 <image> tokens")
        placed = torch.zeros(*tokens.shape, features.shape[-1], dtype=x.dtype, device=x.device)
        placed = placed.masked_scatter(is_image.unsqueeze(-1), features.to(x.dtype))
        mask = is_image.unsqueeze(-1).to(x.dtype)
        if self.split is not None:
            placed, mask = self.split(placed), self.split(mask)
        return x * (1 - mask) + placed


class Llava(Transformer):
    # A pipeline keeps these with the embedding, on the first stage (parallel/pipeline/stage.py).
    first_stage_modules = ("vision", "projector")

    def embedding_parts(self) -> list[str]:
        """The embedding's modules and what feeds it: the image encoder and projector (the first stage's)."""
        return super().embedding_parts() + [n for n in self.first_stage_modules if getattr(self, n, None) is not None]

    def __init__(self, cfg: ModelConfig, family=None):
        super().__init__(cfg, family)
        if cfg.image_token_id < 0:
            raise ValueError("model.image_token_id must be resolved (>= 0; the tokenizer's <image>) before building")
        self.vision = VisionTransformer(cfg)
        self.projector = Projector(cfg.vision_d_model, cfg.d_model)
        self.merge = ImageMerge(cfg.image_token_id)
        self._features: torch.Tensor | None = None  # this forward's image features, read by `embed`
        self.reset_parameters()  # again: the decoder's values are unchanged (same seed), the new parts drawn

    @property
    def tokens_per_image(self) -> int:
        return self.vision.n_patches

    def init_rule(self, name: str) -> InitRule:
        if name == "vision.cls":
            return InitRule("normal", self.cfg.init_std)
        return super().init_rule(name)

    def part_params(self) -> dict[str, list[nn.Parameter]]:
        """The parameters of each part `model.freeze` names."""
        own = {name: list(m.parameters()) if m is not None else [] for name, m in
               (("vision", self.vision), ("projector", self.projector))}
        taken = {id(p) for ps in own.values() for p in ps}
        return {**own, "language": [p for p in self.parameters() if id(p) not in taken]}

    def image_features(self, images: torch.Tensor, n_images: torch.Tensor | None = None) -> torch.Tensor:
        """[rows * slots or N, 3, H, W] images -> projected features [used images * patches, d_model], row-major:
        row 0's images in order, then row 1's, as the <image> tokens come."""
        if images.dim() == 5:
            slots = torch.arange(images.shape[1], device=images.device)
            used = slots[None, :] < n_images.to(images.device)[:, None] if n_images is not None else None
            images = images[used] if used is not None else images.flatten(0, 1)
        feats = self.vision(images)
        if self.vision.has_cls:
            feats = feats[:, 1:]
        return self.projector(feats).flatten(0, 1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None, caches=None, pos: int = 0, span=None,
                seq_len: int | None = None, docs=None, images: torch.Tensor | None = None,
                n_images: torch.Tensor | None = None) -> torch.Tensor:
        """`Transformer.forward` with the images of the rows (see the module docstring); without images (text
        only, or a decoding step after the prompt) it is the decoder's forward."""
        self._features = self.image_features(images, n_images) if images is not None and images.numel() else None
        try:
            return super().forward(x, labels, caches, pos, span, seq_len, docs)
        finally:
            self._features = None

    def embed(self, tokens: torch.Tensor, pos: int = 0, positions: torch.Tensor | None = None) -> torch.Tensor:
        x = super().embed(tokens, pos, positions)
        return x if self._features is None else self.merge(x, tokens, self._features)
