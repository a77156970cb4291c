"""Gemma <-> Hugging Face Gemma2ForCausalLM: tensor names and config.json, both ways.

Gemma 2's layout is Llama's names plus the sandwich norms: ``post_attention_layernorm`` after attention,
``pre_feedforward_layernorm`` / ``post_feedforward_layernorm`` around the MLP (megaloom's ``post_attn_norm``,
``mlp_norm``, ``post_mlp_norm``); HF stores the norms' w of ``1 + w`` as megaloom does, so tensors map as they are.
The window: ``sliding_window`` with ``layer_types`` alternating sliding / full from layer 0 (Gemma 2's pattern)
is ``model.sliding_window``; all ``full_attention`` is a window of 0. ``attn_logit_softcapping`` /
``final_logit_softcapping`` (50 / 30 in every released Gemma 2; null = off) are ``model.attn_softcap`` /
``final_softcap`` (0 = off); ``query_pre_attn_scalar`` is ``model.query_pre_attn_scalar`` where it is not
head_dim (Gemma 2 27B: 144; 0 = head_dim). Refused with the field named: another activation than tanh-GeLU,
attention biases, other layer patterns, bidirectional attention.
"""

from __future__ import annotations

from megaloom.config import ModelConfig
from megaloom.errors import ConversionError
from megaloom.model_keys.shape import resolved_ffn_dim, resolved_head_dim, resolved_kv_heads
from megaloom.models.family import HFMapping
from megaloom.models.gemma.model import is_local
from megaloom.models.hf_common import HFTensors, Tensors, refuse, rope_config, rope_settings
from megaloom.models.llama import hf as llama_hf

LAYER = [("attn_norm.weight", "input_layernorm.weight"),
         ("attn.q_proj.weight", "self_attn.q_proj.weight"),
         ("attn.k_proj.weight", "self_attn.k_proj.weight"),
         ("attn.v_proj.weight", "self_attn.v_proj.weight"),
         ("attn.o_proj.weight", "self_attn.o_proj.weight"),
         ("post_attn_norm.weight", "post_attention_layernorm.weight"),
         ("mlp_norm.weight", "pre_feedforward_layernorm.weight"),
         ("mlp.gate_proj.weight", "mlp.gate_proj.weight"),
         ("mlp.up_proj.weight", "mlp.up_proj.weight"),
         ("mlp.down_proj.weight", "mlp.down_proj.weight"),
         ("post_mlp_norm.weight", "post_feedforward_layernorm.weight")]
GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")


def to_hf_names(sd: Tensors, m: ModelConfig) -> Tensors:
    return llama_hf.to_hf_names(sd, m, LAYER)


def from_hf_names(hf: HFTensors, m: ModelConfig) -> Tensors:
    return llama_hf.from_hf_names(hf, m, LAYER)


def layer_types(n_layers: int, window: int) -> list[str]:
    return ["sliding_attention" if window and is_local(i) else "full_attention" for i in range(n_layers)]


def to_hf_config(m: ModelConfig) -> dict:
    if m.qkv_bias:
        raise ConversionError("model.qkv_bias=true: Gemma2ForCausalLM's attention_bias puts biases on all four "
                              "projections; only models trained with model.qkv_bias=false can be exported.")
    hd = resolved_head_dim(m)
    return {"hidden_size": m.d_model, "intermediate_size": resolved_ffn_dim(m), "num_attention_heads": m.n_heads,
            "num_key_value_heads": resolved_kv_heads(m), "num_hidden_layers": m.n_layers, "head_dim": hd,
            "rms_norm_eps": m.norm_eps, **rope_config(m), "max_position_embeddings": m.max_seq_len,
            "hidden_activation": "gelu_pytorch_tanh", "attention_bias": False, "attention_dropout": 0.0,
            # without a window every layer is full_attention; transformers still builds a sliding mask (unused),
            # which needs a size
            "query_pre_attn_scalar": m.query_pre_attn_scalar or hd, "sliding_window": m.sliding_window or m.max_seq_len,
            "layer_types": layer_types(m.n_layers, m.sliding_window),
            "attn_logit_softcapping": m.attn_softcap or None, "final_logit_softcapping": m.final_softcap or None}


def from_hf_config(hf: dict, where: str) -> dict:
    d, heads, n = hf["hidden_size"], hf["num_attention_heads"], hf["num_hidden_layers"]
    head_dim = hf.get("head_dim") or 256  # Gemma2Config's default
    caps = {}
    for field, key in (("attn_logit_softcapping", "attn_softcap"), ("final_logit_softcapping", "final_softcap")):
        cap = hf.get(field, {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}[field])  # the defaults
        if cap is not None and not (isinstance(cap, int | float) and cap > 0):
            refuse(where, field, cap, "a positive cap, or null for none")
        caps[key] = float(cap or 0.0)
    scalar = hf.get("query_pre_attn_scalar", 256)  # Gemma2Config's default
    if not (isinstance(scalar, int | float) and scalar > 0 and scalar == int(scalar)):
        refuse(where, "query_pre_attn_scalar", scalar, "a positive integer (head_dim in Gemma 2 2B and 9B)")
    caps["query_pre_attn_scalar"] = 0 if scalar == head_dim else int(scalar)
    act = hf.get("hidden_activation") or hf.get("hidden_act", "gelu_pytorch_tanh")
    if act not in GELU_TANH:
        refuse(where, "hidden_activation", act, "the tanh GeLU (gelu_pytorch_tanh)")
    for field in ("attention_bias", "use_bidirectional_attention"):
        if hf.get(field):
            refuse(where, field, hf[field], "false")
    window = hf.get("sliding_window") or 0
    types = hf.get("layer_types") or layer_types(n, window)
    if types == layer_types(n, 0):
        window = 0
    elif types != layer_types(n, window):
        refuse(where, "layer_types", types, "Gemma 2's sliding / full alternation from layer 0, or full everywhere")
    return dict(arch="gemma", preset="gemma-tiny", n_layers=n, d_model=d, n_heads=heads,
                n_kv_heads=hf.get("num_key_value_heads") or heads, head_dim=head_dim, ffn_dim=hf["intermediate_size"],
                vocab_size=hf["vocab_size"], max_seq_len=hf.get("max_position_embeddings", 8192),
                tie_embeddings=bool(hf.get("tie_word_embeddings", True)),  # Gemma2Config's default
                norm_eps=float(hf.get("rms_norm_eps", 1e-6)), init_std=float(hf.get("initializer_range", 0.02)),
                sliding_window=window, **caps, **rope_settings(hf, where))


HF = HFMapping(architecture="Gemma2ForCausalLM", model_types=("gemma2",), to_hf_config=to_hf_config,
               from_hf_config=from_hf_config, to_hf_names=to_hf_names, from_hf_names=from_hf_names,
               sliding_window=True)
