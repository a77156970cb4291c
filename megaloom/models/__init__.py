"""Model definitions: plain PyTorch modules chosen by config."""

from megaloom.models.transformer import Transformer, apply_recompute, count_params, cross_entropy

__all__ = ["Transformer", "apply_recompute", "count_params", "cross_entropy"]
