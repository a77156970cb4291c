"""The model's derived sizes: each size a user may leave at 0 ("auto"), and the one rule that fills it in.

model.n_kv_heads (0: n_heads), model.head_dim (0: d_model / n_heads), model.ffn_dim (0: the family's default for
d_model) and model.expert_ffn_dim (0: the dense MLP's width). Every reader asks these functions, never the rule
again: on a resolved config (the trainer's, `resolved_shape`'s) they read the field, on a config as the user wrote
it (a test's, a planning copy's) they apply the rule, the same rule everywhere. `tests/test_house.py` checks that
no other module writes a rule out (`n_kv_heads or ...`, `ffn_dim or ...`, `default_ffn_dim(`).

The vocabulary is the tokenizer's and the memory plan's choices are the device's: they are resolved above this
package, by `megaloom/planning/shape.py` (the model's shape with the vocabulary) and `megaloom/training/resolve.py`.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from megaloom.model_keys.base import model_rules

if TYPE_CHECKING:
    from megaloom.model_keys import ModelConfig


def resolved_kv_heads(m: ModelConfig) -> int:
    """The key/value heads: model.n_kv_heads, or n_heads (plain multi-head attention) when it is 0."""
    return m.n_kv_heads or m.n_heads


def resolved_head_dim(m: ModelConfig) -> int:
    """The attention head width: model.head_dim, or d_model / n_heads when it is 0 (every layer that sizes heads,
    q/k/v/o, RoPE tables, KV caches, the memory plan and FLOP counts asks this, never d_model / n_heads)."""
    return m.head_dim or m.d_model // m.n_heads


def resolved_ffn_dim(m: ModelConfig) -> int:
    """The dense MLP's width: model.ffn_dim, or the family's default for d_model (4 d_model for GeLU MLPs, the
    SwiGLU rule for gated ones: each family's traits say)."""
    return m.ffn_dim or model_rules().family(m.arch).traits.default_ffn_dim(m.d_model)


def resolved_expert_ffn_dim(m: ModelConfig) -> int:
    """One routed expert's width: model.expert_ffn_dim, or the dense MLP's width when it is 0."""
    return m.expert_ffn_dim or resolved_ffn_dim(m)


def resolved_shape(m: ModelConfig) -> ModelConfig:
    """A copy of ``m`` with n_kv_heads, head_dim and ffn_dim filled in (the vocabulary is the tokenizer's:
    `megaloom.planning.shape.resolved_model`). Latent attention sizes its heads by qk_nope/qk_rope/v_head_dim, so
    model.head_dim stays 0 there (validation refuses any other value, so a resolved d_model / n_heads written to
    config.yaml could not be read back). model.expert_ffn_dim stays as written: 0 is how a run says "as the dense
    MLP", and a preset's MoE width is explicit."""
    head_dim = 0 if m.attention == "mla" else resolved_head_dim(m)
    return dataclasses.replace(m, n_kv_heads=resolved_kv_heads(m), head_dim=head_dim, ffn_dim=resolved_ffn_dim(m))
