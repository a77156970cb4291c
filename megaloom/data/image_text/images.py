"""Image decoding for the encoder: any PIL-readable image -> RGB, centre-cropped to a square, resized (bicubic)
to model.image_size, scaled to [0, 1] and normalised with CLIP's mean and std -> float32 [3, H, W]."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from PIL import Image

from megaloom.data.errors import DataError

MEAN = np.array([0.48145466, 0.4578275, 0.40821073], dtype=np.float32)  # CLIP's (OpenAI) normalisation
STD = np.array([0.26862954, 0.26130258, 0.27577711], dtype=np.float32)


def to_pixels(img: Image.Image, size: int) -> np.ndarray:
    img = img.convert("RGB")
    w, h = img.size
    side = min(w, h)
    left, top = (w - side) // 2, (h - side) // 2
    img = img.crop((left, top, left + side, top + side)).resize((size, size), Image.Resampling.BICUBIC)
    x = np.asarray(img, dtype=np.float32) / 255.0
    return ((x - MEAN) / STD).transpose(2, 0, 1).copy()


def decode(data: bytes | str | Path, size: int, where: str) -> np.ndarray:
    """Decode an image file (path) or its bytes; a file PIL cannot read is a DataError naming it."""
    try:
        with Image.open(io.BytesIO(data) if isinstance(data, bytes) else data) as img:
            return to_pixels(img, size)
    except (OSError, ValueError) as e:
        raise DataError(f"{where}: not a readable image ({e}); fix or remove it from data.images") from e
