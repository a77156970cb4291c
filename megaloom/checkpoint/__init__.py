"""Checkpoints: torch DCP shards written atomically, checksummed, with a `latest` pointer moved last."""

from megaloom.checkpoint.store import CheckpointError, find_checkpoints, load_checkpoint, save_checkpoint

__all__ = ["CheckpointError", "find_checkpoints", "load_checkpoint", "save_checkpoint"]
