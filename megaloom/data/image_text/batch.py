"""A batch of packed image-text rows, as the loader yields it and the training step reads it."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

IGNORE = -100  # the label of tokens that are not trained (images, prompts, padding): cross_entropy's ignore_index


@dataclass
class ImageTextBatch:
    """``tokens`` [B, T+1] int64; ``loss_mask`` [B, T+1] bool, True where a token is a target (answers, captions,
    end-of-document), False on <image> tokens, prompts and padding; ``images`` [B, K, 3, H, W] float32 (the
    first ``n_images[b]`` slots of row b used, in the order of its <image> tokens); ``n_images`` [B] int64."""

    tokens: torch.Tensor
    loss_mask: torch.Tensor
    images: torch.Tensor
    n_images: torch.Tensor

    @classmethod
    def stack(cls, rows: list[dict]) -> ImageTextBatch:
        """Rows as `packed.PackedImageText` returns them -> one batch."""
        return cls(*(torch.from_numpy(np.stack([r[k] for r in rows]))
                     for k in ("tokens", "loss_mask", "images", "n_images")))

    @property
    def shape(self) -> torch.Size:
        return self.tokens.shape

    def _map(self, fn) -> ImageTextBatch:
        return ImageTextBatch(fn(self.tokens), fn(self.loss_mask), fn(self.images), fn(self.n_images))

    def to(self, device, non_blocking: bool = False) -> ImageTextBatch:
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> ImageTextBatch:
        return self._map(lambda t: t.pin_memory())

    def __getitem__(self, rows: slice) -> ImageTextBatch:
        return self._map(lambda t: t[rows])

    def micro_inputs(self, micro: int) -> Iterator[tuple[torch.Tensor, torch.Tensor, dict]]:
        """(inputs, labels, model keyword arguments) per micro-batch of ``micro`` rows: labels are the next tokens,
        IGNORE where they are not targets; the images of those rows go to the model as ``images``/``n_images``."""
        for i in range(0, self.tokens.shape[0], micro):
            part = self[i:i + micro]
            labels = part.tokens[:, 1:].masked_fill(~part.loss_mask[:, 1:], IGNORE)
            yield part.tokens[:, :-1], labels, {"images": part.images, "n_images": part.n_images}
