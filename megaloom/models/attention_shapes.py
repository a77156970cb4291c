"""The attention's shapes from the config alone, for the code that counts without a module (memory plan, FLOP
counter, planner): head sizes and this rank's projection matrices, for grouped-query and latent attention.

Grouped-query attention (`attention.Attention`): q/k/v/o with one head size (`config.resolved_head_dim`:
model.head_dim, or d_model / n_heads). Multi-head latent
attention (`mla.MLAttention`, ``model.attention=mla``): queries through a low-rank latent (or one projection),
keys and values through a shared latent (``kv_a_proj``, which also makes the RoPE key shared by all heads),
up-projected per head; q/k heads are qk_nope_head_dim + qk_rope_head_dim wide, values v_head_dim. Under tensor
parallelism the per-head matrices split by heads and the down-projections are replicated (`models/plan.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

from megaloom.config import ModelConfig
from megaloom.model_keys.shape import resolved_head_dim, resolved_kv_heads


def is_mla(m: ModelConfig) -> bool:
    return getattr(m, "attention", "gqa") == "mla"


def rope_dim(m: ModelConfig) -> int:
    """Width of the RoPE tables: the rotated part of each head (all of it, or MLA's qk_rope_head_dim)."""
    return m.qk_rope_head_dim if is_mla(m) else resolved_head_dim(m)


def qk_head_dim(m: ModelConfig) -> int:
    return m.qk_nope_head_dim + m.qk_rope_head_dim if is_mla(m) else resolved_head_dim(m)


def v_head_dim(m: ModelConfig) -> int:
    return m.v_head_dim if is_mla(m) else resolved_head_dim(m)


def core_head_dim(m: ModelConfig) -> int:
    """The head size the attention kernel runs at: MLA pads the narrower of q/k and v to the wider (mla.py)."""
    return max(qk_head_dim(m), v_head_dim(m))


def attention_width(m: ModelConfig) -> int:
    """n_heads x (q/k head + v head): the per-token, per-key multiply-adds of scores and values (2 x n_heads x
    head_dim for grouped-query attention, whatever n_kv_heads)."""
    return m.n_heads * (qk_head_dim(m) + v_head_dim(m))


@dataclass(frozen=True)
class Projection:
    """One linear of the attention on a tensor-parallel rank: its local (out, in) and how it is split:
    "heads" (column-parallel by heads), "kv" (column-parallel by key/value heads), "replicated" (MLA's
    down-projections: every rank the whole matrix) or "rows" (the output projection, row-parallel)."""

    name: str
    out: int
    inp: int
    split: str

    @property
    def numel(self) -> int:
        return self.out * self.inp


def attention_projections(m: ModelConfig, tp: int = 1) -> list[Projection]:
    """The attention's linears on one of ``tp`` ranks, in the order the forward calls them."""
    d, h = m.d_model, m.n_heads // tp
    if not is_mla(m):
        hd = resolved_head_dim(m)
        hkv = max(resolved_kv_heads(m) // tp, 1)
        return [Projection("q_proj", h * hd, d, "heads"), Projection("k_proj", hkv * hd, d, "kv"),
                Projection("v_proj", hkv * hd, d, "kv"), Projection("o_proj", d, h * hd, "rows")]
    qk = qk_head_dim(m)
    if m.q_lora_rank:
        q = [Projection("q_a_proj", m.q_lora_rank, d, "replicated"),
             Projection("q_b_proj", h * qk, m.q_lora_rank, "heads")]
    else:
        q = [Projection("q_proj", h * qk, d, "heads")]
    return q + [Projection("kv_a_proj", m.kv_lora_rank + m.qk_rope_head_dim, d, "replicated"),
                Projection("kv_b_proj", h * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank, "heads"),
                Projection("o_proj", d, h * m.v_head_dim, "rows")]


def core_widths(m: ModelConfig, tp: int = 1) -> tuple[int, int, int]:
    """Elements per token of q, k and v as they enter the attention kernel on one of ``tp`` ranks (MLA: every
    head expanded and padded to `core_head_dim`)."""
    h = m.n_heads // tp
    if is_mla(m):
        w = core_head_dim(m)
        return h * w, h * w, h * w
    hd = resolved_head_dim(m)
    hkv = max(resolved_kv_heads(m) // tp, 1)
    return h * hd, hkv * hd, hkv * hd


def attention_norm_params(m: ModelConfig) -> int:
    """Weights of the norms inside MLA (over the query and key/value latents; replicated under tp)."""
    return (m.q_lora_rank + m.kv_lora_rank) if is_mla(m) else 0
