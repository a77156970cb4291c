"""data.* -> (train rows, valid rows, tokenizer) for a multimodal model: `build_datasets`' counterpart, called the
same way (`training/data.py`) with the model's image settings bound."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from megaloom.data.corpus import cache_root
from megaloom.data.dataset import SizeOnly
from megaloom.data.errors import DataError
from megaloom.data.image_text.packed import PackedImageText, plan_rows
from megaloom.data.image_text.sources import folder_records, synthetic_records
from megaloom.data.image_text.tokens import encode_records, image_text_tokenizer
from megaloom.observe.log import get_logger

if TYPE_CHECKING:
    from megaloom.config import DataConfig, ModelConfig

log = get_logger(__name__)
SYNTHETIC_SEED = 0  # the synthetic set's content is fixed (like the embedded text corpus); train.seed orders it


def _split(n: int, split: str) -> int:
    """The number of records in the training part (data.split "train,valid" percentages, contiguous)."""
    try:
        train, valid = (float(x) for x in split.split(","))
    except ValueError:
        raise DataError(f"data.split={split!r}: expected two percentages 'train,valid', e.g. 98,2") from None
    n_train = int(round(n * train / (train + valid)))
    if not 0 < n_train < n:
        raise DataError(f"data.split={split!r} leaves no records for training or validation out of {n}; "
                        "use more records or other percentages")
    return n_train


def build_image_text_datasets(data: DataConfig, seq_len: int, seed: int, n_train: int, n_valid: int,
                              reads_data: bool = True, *, model: ModelConfig) -> tuple:
    records = folder_records(data.images) if data.images else synthetic_records(data.synthetic_samples,
                                                                                SYNTHETIC_SEED)
    tok = image_text_tokenizer(data.tokenizer, records, cache_root(data.cache_dir), data.default_vocab_size)
    if not reads_data:
        return SizeOnly(n_train), SizeOnly(n_valid), tok
    per_image = (model.image_size // model.patch_size) ** 2
    encoded = encode_records(records, tok, per_image)
    lengths = np.array([len(t) for t, _ in encoded])
    n_images = np.array([len(r["images"]) for r in records])
    cut = _split(len(records), data.split)
    out = []
    for part, (lo, hi), n_rows, salt in (("train", (0, cut), n_train, 0), ("valid", (cut, len(records)), n_valid, 1)):
        rows, skipped = plan_rows(lengths[lo:hi], n_images[lo:hi], seq_len + 1, data.max_images, seed + salt,
                                  max(n_rows, 1))
        if skipped:
            log.warning(f"data: {skipped} {part} image-text record(s) longer than train.seq_len + 1 = {seq_len + 1} "
                        f"tokens or with more than data.max_images={data.max_images} images were left out")
        rows = [[r + lo for r in row] for row in rows]
        out.append(PackedImageText(records, encoded, rows, seq_len + 1, data.max_images, model.image_size,
                                   tok.eod_id))
    return out[0], out[1], tok
