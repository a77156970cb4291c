"""Checkpoints: torch DCP shards written atomically, checksummed, with a `latest` pointer moved last;
blocking (`save_checkpoint`) or in two stages with a background writer (`AsyncCheckpointer`)."""

from megaloom.checkpoint.async_save import AsyncCheckpointer, SaveRecord
from megaloom.checkpoint.store import (
    CheckpointError,
    find_checkpoints,
    load_checkpoint,
    load_newest,
    save_checkpoint,
)

__all__ = ["AsyncCheckpointer", "CheckpointError", "SaveRecord", "find_checkpoints", "load_checkpoint", "load_newest",
           "save_checkpoint"]
