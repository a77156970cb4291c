"""Gemma 2's keys (megaloom/models/gemma/): soft-capping of attention and final logits, the query scale. Refused
for families without the traits `softcap` / `query_scale` (megaloom/models/rules.py)."""

from __future__ import annotations

from dataclasses import dataclass

from megaloom.model_keys.base import _f


@dataclass
class GemmaKeys:
    attn_softcap: float = _f(0.0, "Attention-logit soft-capping (Gemma 2: 50): each score q.k / sqrt(d) becomes "
                                  "cap * tanh(score / cap) before the softmax; the fused kernels cannot apply it, so "
                                  "the attention core runs the math path (train.attention=auto picks math). 0 = off.")
    final_softcap: float = _f(0.0, "Final-logit soft-capping (Gemma 2: 30): the head's logits become "
                                   "cap * tanh(logits / cap) (train.fused_loss=auto stays off). 0 = off.")
    query_pre_attn_scalar: int = _f(0, "Gemma 2: attention scores scaled by query_pre_attn_scalar^-1/2 instead of "
                                       "head_dim^-1/2 (Gemma 2 27B: 144 = d_model / n_heads, heads of 128). 0 = "
                                       "head_dim.")
