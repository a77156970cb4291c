"""The shared decoder's keys (megaloom/models/transformer.py), which every family reads: the model's name and shape,
its positions and the RoPE tables' scaling, biases, dropout, init; and the checks that need no family."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from megaloom.model_keys.base import _f, divisors, family_names, require
from megaloom.model_keys.shape import resolved_kv_heads

if TYPE_CHECKING:
    from megaloom.model_keys import ModelConfig


@dataclass
class DecoderKeys:
    preset: str = _f("tiny", "Named model shape (see megaloom.models.presets); other model keys override it.")
    arch: str = _f("llama", "Model family: a folder megaloom/models/<family>/ listed in megaloom/models/registry.py "
                            "(gpt2: LayerNorm, GeLU, learned positions, biases; llama: RMSNorm, SwiGLU, RoPE, GQA; "
                            "bert: masked-LM encoder; t5: span-corruption encoder-decoder).",
                   family_names, shape=True)
    n_layers: int = _f(4, "Number of transformer blocks.", shape=True)
    d_model: int = _f(128, "Hidden size.", shape=True)
    n_heads: int = _f(4, "Attention (query) heads.", shape=True)
    n_kv_heads: int = _f(0, "Key/value heads for grouped-query attention; 0 = n_heads (multi-head attention).",
                         shape=True)
    head_dim: int = _f(0, "Width of one attention head; 0 = d_model / n_heads. Set it where a model's heads are "
                          "wider or narrower than that (Qwen3-0.6B/4B/32B: 128): q/k/v project d_model to "
                          "heads x head_dim, o_proj back to d_model.", shape=True)
    ffn_dim: int = _f(0, "MLP hidden size; 0 = 4*d_model (gpt2) or the Llama rule 8/3*d_model rounded to 256.",
                      shape=True)
    vocab_size: int = _f(0, "Embedding rows; 0 = the tokenizer's vocabulary padded to a multiple of 64.", shape=True)
    max_seq_len: int = _f(1024, "Longest sequence the position embedding / RoPE tables cover.", shape="positions")
    tie_embeddings: bool = _f(True, "Share the input embedding and the output head weights.", shape=True)
    norm_eps: float = _f(1e-5, "Epsilon of LayerNorm / RMSNorm.")
    rope_theta: float = _f(10000.0, "RoPE base frequency (families with rotary positions).")
    rope_scaling: str = _f("none", "RoPE frequency scaling for contexts beyond pretraining, applied to the RoPE tables "
                                   "in training and generation: none; llama3 (Llama 3.1/3.2/3.3: low frequencies / "
                                   "model.rope_factor, high ones kept, a smooth ramp between); yarn (YaRN as Qwen "
                                   "and transformers' rope_type 'yarn' compute it). Set by `megaloom convert "
                                   "--from-hf` from config.json's rope_scaling / rope_parameters.",
                           ("none", "llama3", "yarn"))
    rope_factor: float = _f(1.0, "With model.rope_scaling: the context extension factor (Llama 3.1: 8, Llama 3.2: "
                                 "32; HF's factor).")
    rope_original_max_len: int = _f(0, "With model.rope_scaling: the context length of pretraining (HF's "
                                       "original_max_position_embeddings; Llama 3.1: 8192); must be > 0 then.")
    rope_low_freq_factor: float = _f(1.0, "With model.rope_scaling=llama3: wavelengths above rope_original_max_len / "
                                          "this are divided by rope_factor (HF's low_freq_factor).")
    rope_high_freq_factor: float = _f(4.0, "With model.rope_scaling=llama3: wavelengths below rope_original_max_len "
                                           "/ this are kept (HF's high_freq_factor).")
    rope_beta_fast: float = _f(32.0, "With model.rope_scaling=yarn: dimensions turning more often than this within "
                                     "rope_original_max_len keep their frequency (HF's beta_fast).")
    rope_beta_slow: float = _f(1.0, "With model.rope_scaling=yarn: dimensions turning less often than this are "
                                    "interpolated, / rope_factor (HF's beta_slow).")
    rope_attention_factor: float = _f(0.0, "With model.rope_scaling=yarn: scale of cos/sin (HF's attention_factor); "
                                           "0 = 0.1 * ln(rope_factor) + 1.")
    rope_truncate: bool = _f(True, "With model.rope_scaling=yarn: round the interpolation ramp's ends to whole "
                                   "dimensions (HF's truncate).")
    qkv_bias: bool = _f(False, "Biases on the q/k/v projections only (Qwen style); families with biases everywhere "
                               "(gpt2) have them anyway.", shape=True)
    dropout: float = _f(0.0, "Dropout on attention probabilities and residual branches.")
    init_std: float = _f(0.02, "Std of the normal init; output projections use init_std/sqrt(2*n_layers). Models "
                               "wider than 256: min(0.02, sqrt(2/(5*d_model))) (megaloom/models/recipes.py).")
    parallel_block: bool = _f(False, "MegaScale/GPT-J parallel block: attention and MLP read the same normed input.",
                              shape=True)
    sliding_window: int = _f(0, "Sliding-window attention span in tokens; 0 = full causal attention.")


def check_heads(m: ModelConfig) -> None:
    """The attention heads divide the width (or model.head_dim sets it), and the query heads the key/value heads."""
    require(m.head_dim >= 0, f"model.head_dim must be >= 0 (0 = d_model / n_heads), got {m.head_dim}.")
    require(m.head_dim > 0 or m.d_model % m.n_heads == 0,
            f"model.d_model ({m.d_model}) must be divisible by model.n_heads ({m.n_heads}); "
            f"head counts that would work: {divisors(m.d_model, m.n_heads)} (or set model.head_dim).")
    kv = resolved_kv_heads(m)
    require(m.n_heads % kv == 0,
            f"model.n_heads ({m.n_heads}) must be a multiple of model.n_kv_heads ({kv}); "
            f"n_kv_heads that would work: {divisors(m.n_heads)}.")
