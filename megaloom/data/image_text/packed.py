"""Rows of packed image-text records: the plan (which records share row i) and the dataset that assembles row i.

The plan is data/rows.py's greedy packing of whole records with two budgets: a record goes into the current row if
its tokens fit in train.seq_len + 1 and its images in data.max_images, otherwise the row is closed (padded with
end-of-document tokens that are not targets) and the record starts the next one. Row i depends only on (records,
seq_len, max_images, seed), never on how many rows were asked for: a resumed run reads exactly the rows it would
have read. A record too long for a row on its own is left out (counted in ``skipped``).

Decoding happens in `__getitem__`, i.e. in the DataLoader's worker processes (data.num_workers), ahead of the
step that needs the row.
"""

from __future__ import annotations

import numpy as np

from megaloom.data.errors import DataError
from megaloom.data.image_text import synthetic
from megaloom.data.image_text.images import decode, to_pixels
from megaloom.data.image_text.sources import load_image_bytes
from megaloom.data.rows import greedy_rows


def plan_rows(lengths: np.ndarray, n_images: np.ndarray, row_len: int, max_images: int, seed: int,
              n_rows: int) -> tuple[list[list[int]], int]:
    """(record indices of each of the first ``n_rows`` rows, records skipped as too long for a row): the shared
    greedy packing (data/rows.py) with two budgets, the row's tokens and data.max_images."""
    fits = (lengths <= row_len) & (n_images <= max_images)
    if not fits.any():
        raise DataError(f"no image-text record fits one row of train.seq_len + 1 = {row_len} tokens with at most "
                        f"data.max_images={max_images} images (shortest record: {int(lengths.min())} tokens); raise "
                        "train.seq_len or data.max_images, or use smaller images (model.patch_size)")
    return greedy_rows([lengths, n_images], [row_len, max_images], seed, n_rows)


class PackedImageText:
    """Row i: {"tokens" [T+1] int64, "loss_mask" [T+1] bool, "images" [K, 3, S, S] float32, "n_images" int64}."""

    def __init__(self, records: list[dict], encoded: list[tuple[np.ndarray, np.ndarray]], rows: list[list[int]],
                 row_len: int, max_images: int, image_size: int, pad_id: int) -> None:
        self.records, self.encoded, self.rows = records, encoded, rows
        self.row_len, self.max_images, self.image_size, self.pad_id = row_len, max_images, image_size, pad_id

    def __len__(self) -> int:
        return len(self.rows)

    def image(self, ref: tuple) -> np.ndarray:
        if ref[0] == "synthetic":
            return to_pixels(synthetic.draw(*ref[1:]), self.image_size)
        data, where = load_image_bytes(ref)
        return decode(data, self.image_size, where)

    def __getitem__(self, i: int) -> dict:
        tokens = np.full(self.row_len, self.pad_id, dtype=np.int64)
        mask = np.zeros(self.row_len, dtype=bool)
        images = np.zeros((self.max_images, 3, self.image_size, self.image_size), dtype=np.float32)
        at = n = 0
        for r in self.rows[i]:
            ids, targets = self.encoded[r]
            tokens[at:at + len(ids)], mask[at:at + len(ids)] = ids, targets
            at += len(ids)
            for ref in self.records[r]["images"]:
                images[n] = self.image(ref)
                n += 1
        return {"tokens": tokens, "loss_mask": mask, "images": images, "n_images": np.int64(n)}
