"""What multi-head latent attention (model.attention=mla, megaloom/models/mla.py) saves for backward in one block
and micro-batch: the memory plan's attention term for it (`memory_activations.block_activation_bytes` calls this in
place of the grouped-query one). Checked tensor by tensor with saved-tensor hooks on CPU, fp32 and bf16, with
and without query compression (tests/planning/test_memory_mla.py).

With n tokens in the region (n_r in the sp residual stream), h heads on this rank, w = max(q/k head, v head)
the head size the core runs at (the narrower side padded, mla.py), a bytes per activation element:

  inputs       q_proj / q_a_proj and kv_a_proj read the normed x: under autocast a cast each (2 x a n d), in fp32
               the shared x (4 n d); with sp one shard for both (a n_r d, sp_linear): they are the region's linears
  latent norms kv_a_norm over kv_lora_rank (and q_a_norm over q_lora_rank): RMSNorm's composite (input,
               rsqrt, x * rsqrt). In fp32 its input is a view of the projection's output and keeps all of it
               (kv_a_proj's rope columns too); under autocast the bf16 output meets the fp32 weight and is
               upcast, which is what is kept. Then the up-projection's input: its cast (a) or the fp32 output
  core         the fused kernels: q, k, v, out at w per head and the fp32 logsumexp; the math kernel as for
               grouped-query attention (fp32 q, k, v, the probabilities). An unpadded v is a view of kv_b_proj's
               output and keeps all of it (k_nope too)
  o_proj       its input [n, h v]: a copy when v is the padded side (the slice of out is not contiguous; the fused
               kernels' out is laid out [b, t, h, w], so otherwise a view), always with the math kernel
"""

from __future__ import annotations

import math

from megaloom.accelerator import is_cuda
from megaloom.config import ModelConfig


def is_mla(m: ModelConfig) -> bool:
    return getattr(m, "attention", "gqa") == "mla"


def latent_norm_bytes(n: int, width: int, stored: int, autocast: bool) -> int:
    """A latent RMSNorm over ``width`` and its up-projection's input; ``stored``: the width of the tensor its
    input is a view of (kv_a_proj's output: kv_lora_rank + qk_rope_head_dim)."""
    if autocast:  # upcast input, rsqrt, x * rsqrt (fp32), then the up-projection's bf16 cast
        return 8 * n * width + 4 * n + 2 * n * width
    return 4 * n * stored + 4 * n + 4 * n * width + 4 * n * width


def mla_attention_bytes(m: ModelConfig, *, n: int, n_r: int, b: int, t: int, heads: int, a: int, autocast: bool,
                        sp: bool, attention: str, selective: bool, device: str, dropout_mask: int) -> dict[str, int]:
    """The attention half of one MLA block's save-set (module doc); ``attention``: "flash" / "efficient" (fused)
    or "math"; ``dropout_mask``: bytes per element of the math kernel's dropout mask."""
    from megaloom.models.attention_shapes import core_head_dim

    d, w, v = m.d_model, core_head_dim(m), m.v_head_dim
    out: dict[str, int] = {}
    if sp:
        out["q/kv down-projection input"] = a * n_r * d
    else:
        out["q/kv down-projection inputs"] = 2 * 2 * n * d if autocast else 4 * n * d
    if m.q_lora_rank:
        out["q latent norm"] = latent_norm_bytes(n, m.q_lora_rank, m.q_lora_rank, autocast)
    out["kv latent norm"] = latent_norm_bytes(n, m.kv_lora_rank, m.kv_lora_rank + m.qk_rope_head_dim, autocast)
    q = a * n * heads * w
    # v padded: a new tensor of w per head; else a view of kv_b_proj's output [n, h (nope + v)]
    v_saved = q if v < w else a * n * heads * (m.qk_nope_head_dim + v)
    if attention in ("flash", "efficient"):
        out["q, k, v (padded heads)"] = 2 * q + v_saved
        out["attention out"] = q
        out["logsumexp"] = 4 * b * heads * (32 * math.ceil(t / 32) if attention == "efficient" else t)
        if is_cuda(device):
            out["rng seed, offset"] = 16
        if m.sliding_window:  # the boolean window mask as an additive one in the compute dtype
            out["window mask"] = a * t * (16 * math.ceil(t / 16) if is_cuda(device) else t)
    else:
        e = 4
        if selective:
            out["q, k, v (padded heads)"] = 2 * q + v_saved
        else:
            out["q, k, v (math)"] = 3 * e * n * heads * w
            out["attention probs (math)"] = e * b * heads * t * t
            if m.dropout > 0:
                out["attention dropout (math)"] = (dropout_mask + e) * b * heads * t * t
        out["o_proj input (math)"] = a * n * heads * v  # [b, h, t, .] -> [b, t, h v]: a copy
        return out
    if v < w:
        out["o_proj input (sliced heads)"] = a * n * heads * v
    return out
