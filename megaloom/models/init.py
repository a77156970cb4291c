"""Initial values that do not depend on the layout: each element is a function of (seed, name, position).

A rank that holds a slice of a parameter (a tensor-parallel shard, a pipeline stage's layers, an expert-parallel
rank's experts, a ZeRO-3 shard) must start from exactly the values the single process starts from, without ever
building the whole model. So random parameters are drawn in fixed tiles: the tensor, viewed as rows of its last
dimension, is cut into column blocks of COLUMN_BLOCK columns (one block when the rows are no wider) and bands of
rows, each tile (a band of one block) about TILE_ELEMENTS, and tile i of parameter ``name`` (band by band, block
by block) comes from a generator seeded by (the model's init seed, name, i). A slice generates only the tiles it
overlaps: a slice of rows (column-parallel weights, vocabulary shards, pipeline stages, experts, ZeRO-3) the bands
of its rows, a slice of columns (row-parallel weights) the blocks of its columns, so a rank's work is its shard
plus at most a band and a block at its edges, and its memory its shard plus one tile. The same tiles on the same
device type give the same numbers; a GPU's generator differs from the CPU's, as before.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

TILE_ELEMENTS = 1 << 16  # 256 KB of fp32 per tile: the only buffer beyond the shard
COLUMN_BLOCK = 512  # columns per tile of wider rows: tp's column slices of published shapes are multiples of it


@dataclass(frozen=True)
class InitRule:
    """``normal`` (mean 0, ``std``), ``uniform`` (on [-std, std]: LoRA's A, models/lora.py), ``zeros`` or
    ``ones``."""

    kind: str
    std: float = 0.0


ZEROS, ONES = InitRule("zeros"), InitRule("ones")


def draw_init_seed() -> int:
    """One number from the global generator: seeding (``torch.manual_seed``) fixes a model's initial values,
    and two models built one after the other still differ."""
    return int(torch.randint(0, 2**62, (1,), device="cpu").item())


def _tile_seed(base: int, name: str, tile: int) -> int:
    return (base * 1_000_003 + zlib.crc32(name.encode()) * 65_537 + tile) % (2**63 - 1)


@torch.no_grad()
def fill_slice(out: torch.Tensor, full_shape: Sequence[int], starts: Sequence[int], rule: InitRule, seed: int,
               name: str) -> int:
    """Fill ``out`` with the values of the box ``[starts, starts + out.shape)`` of the full tensor ``name``.

    ``out`` is contiguous, on any device but meta, shaped like the box. The full tensor is never built. Returns the
    number of random values drawn (the work: the tiles the box overlaps)."""
    if out.device.type == "meta":
        return 0
    if rule.kind == "zeros":
        out.zero_()
        return 0
    if rule.kind == "ones":
        out.fill_(1.0)
        return 0
    if rule.kind not in ("normal", "uniform"):
        raise ValueError(f"unknown init rule {rule.kind!r} for {name}")
    # The same tiles either way: a uniform tile is drawn where a normal one would be, so slices stay exact.
    draw = torch.randn if rule.kind == "normal" else _symmetric_uniform
    full = list(full_shape) if full_shape else [1]
    lead, cols = full[:-1], full[-1]
    c0, nc = (starts[-1] if starts else 0), (out.shape[-1] if out.dim() else 1)
    block = min(cols, COLUMN_BLOCK)
    n_blocks = -(-cols // block)
    rows_per_band = max(1, TILE_ELEMENTS // block)
    n_rows = math.prod(lead)
    # The global row ids of the box, in the box's own row-major order (ascending).
    rows = torch.zeros((), dtype=torch.long)
    for size, start, length in zip(lead, starts[:-1], out.shape[:-1], strict=True):
        rows = rows.unsqueeze(-1) * size + torch.arange(start, start + length)
    rows = rows.reshape(-1)
    dest = out.view(-1, nc)
    bands = rows // rows_per_band
    unique = torch.unique(bands)
    bounds = torch.searchsorted(bands, unique, right=False).tolist() + [rows.numel()]
    gen = torch.Generator(device=out.device)
    drawn = 0
    for i, t in enumerate(unique.tolist()):
        lo, hi = bounds[i], bounds[i + 1]
        t_rows = min(rows_per_band, n_rows - t * rows_per_band)
        local = (rows[lo:hi] - t * rows_per_band).to(out.device)
        for c in range(c0 // block, (c0 + nc - 1) // block + 1):  # the column blocks the box overlaps
            b0 = c * block
            width = min(block, cols - b0)
            gen.manual_seed(_tile_seed(seed, name, t * n_blocks + c))
            tile = draw(t_rows, width, generator=gen, device=out.device, dtype=torch.float32)
            drawn += tile.numel()
            a, e = max(c0, b0), min(c0 + nc, b0 + width)
            dest[lo:hi, a - c0:e - c0] = (tile[local, a - b0:e - b0] * rule.std).to(out.dtype)
    return drawn


def _symmetric_uniform(*size: int, generator: torch.Generator, device, dtype) -> torch.Tensor:
    """U(-1, 1), drawn as torch.rand draws (scaled by the rule's bound like a normal tile by its std)."""
    return torch.rand(*size, generator=generator, device=device, dtype=dtype).mul_(2).sub_(1)
