"""What data.format=chat refuses, checked by preflight before any process group, data or model exists."""

from __future__ import annotations

from typing import TYPE_CHECKING

from megaloom.config import ConfigError

if TYPE_CHECKING:
    from megaloom.config import Config


def check_chat_config(cfg: Config) -> None:
    d, m = cfg.data, cfg.model
    if d.format != "chat":
        return
    if not d.paths:
        raise ConfigError("data.format=chat needs data.paths: JSONL conversation files (or folders of them), one "
                          '{"messages": [{"role": ..., "content": ...}, ...]} a line.')
    if d.weights:
        raise ConfigError("data.weights with data.format=chat: conversation files are read as one pool, not blended; "
                          "leave data.weights empty (repeat a file in data.paths to weight it up).")
    from megaloom.models.registry import FAMILIES, get_family

    if get_family(m.arch).objective is not None:
        decoders = ", ".join(f.name for f in FAMILIES.values() if f.objective is None and f.dense_decoder)
        raise ConfigError(f"data.format=chat with model.arch={m.arch}: chat fine-tuning trains a decoder's "
                          f"next-token loss on the assistant's tokens, and {m.arch} trains its own objective; use a "
                          f"decoder ({decoders}) or data.format=tokens.")
    if get_family(m.arch).reads_images(m):
        raise ConfigError("data.format=chat with an image encoder (model.vision_layers > 0): image-text data has its "
                          "own records (data.images, docs/multimodal.md); set data.format=tokens.")
