"""Moved to `megaloom.models.hf_moe` (the families' MoE mappings are built from it, and convert/ is built on the
families); the names stay importable from here."""

from megaloom.models.hf_moe import moe_layer_from_hf, moe_layer_to_hf

__all__ = ["moe_layer_from_hf", "moe_layer_to_hf"]
