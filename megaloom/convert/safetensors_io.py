"""Reading and writing Hugging Face weight files: model.safetensors, or shards plus model.safetensors.index.json.

safetensors holds raw tensors and a JSON header, so reading it runs no code. pytorch_model.bin (a pickle) is
refused rather than unpickled.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from megaloom.convert.errors import ConversionError

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
DEFAULT_SHARD_BYTES = 5 * 2**30  # the size transformers' save_pretrained has long used


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def plan_shards(tensors: dict[str, torch.Tensor], max_shard_bytes: int) -> list[list[str]]:
    """Tensor names per shard, in order; a shard closes before it would exceed max_shard_bytes (a tensor
    larger than that gets a shard of its own)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        if shards[-1] and size + _nbytes(t) > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += _nbytes(t)
    return shards


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def save_weights(tensors: dict[str, torch.Tensor], out_dir: Path, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                 show_progress: bool = True) -> list[Path]:
    """Write `tensors` as model.safetensors, or as model-0000i-of-0000n.safetensors + index above the limit."""
    shards = plan_shards(tensors, max_shard_bytes)
    n = len(shards)
    names = [SINGLE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    written = []
    with tqdm(total=len(tensors), desc="writing safetensors", unit="tensor", disable=not show_progress) as bar:
        for fname, shard in zip(names, shards, strict=True):
            part = {}
            for name in shard:
                part[name] = tensors[name]
                bar.update(1)
            tmp = out_dir / f".{fname}.tmp"
            save_file(part, str(tmp), metadata={"format": "pt"})  # transformers checks format == "pt"
            os.chmod(tmp, 0o666 & ~_umask())  # save_file creates 0600; the other exported files follow the umask
            os.replace(tmp, out_dir / fname)
            written.append(out_dir / fname)
    if n > 1:
        index = {"metadata": {"total_size": sum(_nbytes(t) for t in tensors.values())},
                 "weight_map": {name: fname for fname, shard in zip(names, shards, strict=True) for name in shard}}
        (out_dir / INDEX).write_text(json.dumps(index, indent=2))
        written.append(out_dir / INDEX)
    return written


def weight_files(hf_dir: Path) -> list[Path]:
    """The safetensors files of an HF model directory (from the index when sharded)."""
    if (hf_dir / INDEX).is_file():
        try:
            weight_map = json.loads((hf_dir / INDEX).read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ConversionError(f"{hf_dir / INDEX}: not a valid safetensors index ({e!r}).") from e
        files = [hf_dir / f for f in dict.fromkeys(weight_map.values())]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ConversionError(f"{hf_dir / INDEX} lists shards that are missing: {', '.join(missing)}.")
        return files
    if (hf_dir / SINGLE).is_file():
        return [hf_dir / SINGLE]
    pickled = [p.name for p in hf_dir.glob("*.bin")]
    hint = (f" It has {', '.join(pickled)}: pickled weights are not read (loading them can run code); re-save "
            "the model with save_pretrained(..., safe_serialization=True).") if pickled else ""
    raise ConversionError(f"{hf_dir}: no {SINGLE} or {INDEX} found.{hint}")


def load_weights(hf_dir: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in weight_files(hf_dir):
        try:
            with safe_open(str(f), framework="pt") as sf:
                for name in sf.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    out[name] = sf.get_tensor(name)
        except SafetensorError as e:  # truncated, a damaged header, not a safetensors file at all
            raise ConversionError(f"{f}: not a readable safetensors file ({e}); download or export it again.") from e
    return out
