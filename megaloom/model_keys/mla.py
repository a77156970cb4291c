"""Multi-head latent attention's keys (DeepSeek-V2/V3, megaloom/models/mla.py): keys and values through one low-rank
latent per token, queries optionally too, a RoPE key part shared by all heads. Whether a family can take it is the
family rules' question (megaloom/models/rules.py); the shape's own checks are here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from megaloom.model_keys.base import _f, require

if TYPE_CHECKING:
    from megaloom.model_keys import ModelConfig


@dataclass
class MlaKeys:
    attention: str = _f("gqa", "Attention kind: gqa (multi-head / grouped-query, n_kv_heads) or mla (DeepSeek's "
                               "multi-head latent attention: model.kv_lora_rank, q_lora_rank, qk_nope_head_dim, "
                               "qk_rope_head_dim, v_head_dim; families with rotary positions and the plain "
                               "attention).", ("gqa", "mla"), shape=True)
    q_lora_rank: int = _f(0, "With model.attention=mla: rank of the queries' low-rank compression (DeepSeek-V3: "
                             "1536); 0 = one full query projection (DeepSeek-V2-Lite).", shape=True)
    kv_lora_rank: int = _f(0, "With model.attention=mla: width of the compressed key/value latent per token "
                              "(DeepSeek-V3: 512), what an inference cache holds beside the RoPE key.", shape=True)
    qk_nope_head_dim: int = _f(0, "With model.attention=mla: per-head query/key dimensions without rotary "
                                  "positions (DeepSeek-V3: 128).", shape=True)
    qk_rope_head_dim: int = _f(0, "With model.attention=mla: per-head query dimensions with rotary positions, "
                                  "matched by one RoPE key shared by all heads (DeepSeek-V3: 64; even).", shape=True)
    v_head_dim: int = _f(0, "With model.attention=mla: per-head value dimensions (DeepSeek-V3: 128).", shape=True)
    rope_mscale_all_dim: float = _f(1.0, "With model.attention=mla and model.rope_scaling=yarn: the softmax scale "
                                         "is multiplied by (0.1 * this * ln(model.rope_factor) + 1)^2, DeepSeek's "
                                         "mscale (HF's mscale_all_dim; 0 = unchanged).")


def check(m: ModelConfig) -> None:
    """model.attention=mla's keys describe a shape."""
    for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        require(getattr(m, key) >= 1, f"model.attention=mla needs model.{key} >= 1, got {getattr(m, key)} "
                                      "(DeepSeek-V3: kv_lora_rank 512, qk_nope_head_dim 128, qk_rope_head_dim 64, "
                                      "v_head_dim 128).")
    require(m.q_lora_rank >= 0, f"model.q_lora_rank must be >= 0 (0 = no query compression), got {m.q_lora_rank}.")
    require(m.qk_rope_head_dim % 2 == 0, f"model.qk_rope_head_dim ({m.qk_rope_head_dim}) must be even for RoPE.")
    require(m.n_kv_heads in (0, m.n_heads),
            f"model.n_kv_heads={m.n_kv_heads} with model.attention=mla: every head reads keys and values from the "
            "one shared latent, so there are no key/value head groups; set model.n_kv_heads=0.")
    require(m.rope_mscale_all_dim >= 0, f"model.rope_mscale_all_dim must be >= 0, got {m.rope_mscale_all_dim}.")
    # d_model / n_heads is what 0 means (and what config.yaml of megaloom before issue 49 carried under MLA): the
    # same as 0, read back; any other width is a mistake.
    require(not m.head_dim or m.head_dim * m.n_heads == m.d_model,
            f"model.head_dim={m.head_dim} with model.attention=mla: latent attention's heads are "
            "model.qk_nope_head_dim + model.qk_rope_head_dim wide (queries, keys) and "
            "model.v_head_dim (values); set model.head_dim=0.")
