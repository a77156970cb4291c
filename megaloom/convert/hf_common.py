"""Moved to `megaloom.models.hf_common` (the families' HF mappings are built from it, and convert/ is built on the
families); the names stay importable from here."""

from megaloom.models.hf_common import HFTensors, Tensors, refuse, rope_config, rope_settings, rope_theta

__all__ = ["HFTensors", "Tensors", "refuse", "rope_config", "rope_settings", "rope_theta"]
