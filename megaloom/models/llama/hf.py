"""Llama <-> Hugging Face LlamaForCausalLM: tensor names and config.json, both ways.

Renaming only: megaloom's RoPE already uses the rotate-half layout of HF's Llama, so q/k projections need no
permutation (tests compare logits). Anything LlamaConfig can express that megaloom would compute differently
is refused with the field's name.
"""

from __future__ import annotations

from megaloom.config import ModelConfig
from megaloom.errors import ConversionError
from megaloom.model_keys.shape import resolved_ffn_dim, resolved_head_dim, resolved_kv_heads
from megaloom.models.family import HFMapping
from megaloom.models.hf_common import HFTensors, Tensors, refuse, rope_config, rope_settings

# (megaloom name inside layers.{i}., HF name inside model.layers.{i}.)
LAYER = [("attn_norm.weight", "input_layernorm.weight"),
         ("attn.q_proj.weight", "self_attn.q_proj.weight"),
         ("attn.k_proj.weight", "self_attn.k_proj.weight"),
         ("attn.v_proj.weight", "self_attn.v_proj.weight"),
         ("attn.o_proj.weight", "self_attn.o_proj.weight"),
         ("mlp_norm.weight", "post_attention_layernorm.weight"),
         ("mlp.gate_proj.weight", "mlp.gate_proj.weight"),
         ("mlp.up_proj.weight", "mlp.up_proj.weight"),
         ("mlp.down_proj.weight", "mlp.down_proj.weight")]
GLOBAL = [("tok_emb.weight", "model.embed_tokens.weight"), ("norm.weight", "model.norm.weight")]


def to_hf_names(sd: Tensors, m: ModelConfig, layer: list = LAYER) -> Tensors:
    out = {hf: sd[ml] for ml, hf in GLOBAL}
    for i in range(m.n_layers):
        for ml, hf in layer:
            out[f"model.layers.{i}.{hf}"] = sd[f"layers.{i}.{ml}"]
    return out


def from_hf_names(hf: HFTensors, m: ModelConfig, layer: list = LAYER) -> Tensors:
    sd = {ml: hf.take(name) for ml, name in GLOBAL}
    for i in range(m.n_layers):
        for ml, name in layer:
            sd[f"layers.{i}.{ml}"] = hf.take(f"model.layers.{i}.{name}")
    return sd


def decoder_config(m: ModelConfig) -> dict:
    """The config.json fields Llama-style decoders (Llama, Qwen3) spell alike."""
    return {"hidden_size": m.d_model, "intermediate_size": resolved_ffn_dim(m), "num_attention_heads": m.n_heads,
            "num_key_value_heads": resolved_kv_heads(m), "num_hidden_layers": m.n_layers,
            "head_dim": resolved_head_dim(m), "rms_norm_eps": m.norm_eps, **rope_config(m),
            "max_position_embeddings": m.max_seq_len, "hidden_act": "silu", "attention_bias": False,
            "attention_dropout": 0.0}


def to_hf_config(m: ModelConfig) -> dict:
    if m.qkv_bias:
        raise ConversionError("model.qkv_bias=true: LlamaForCausalLM's attention_bias puts biases on all four "
                              "attention projections (o_proj too), so q/k/v-only biases cannot be expressed. Only "
                              "models trained with model.qkv_bias=false can be exported as Llama.")
    return {**decoder_config(m), "mlp_bias": False, "pretraining_tp": 1}


def decoder_settings(hf: dict, where: str, head_dim_default: int | None = None) -> dict:
    """model.* values from the config.json fields Llama-style decoders spell alike, refusing what megaloom would
    compute differently. ``head_dim_default``: the HF class's head_dim when config.json has none (None:
    hidden_size / num_attention_heads). The head width becomes model.head_dim, whatever it is (Qwen3-0.6B's 128
    heads are wider than 1024 / 16)."""
    d, heads = hf["hidden_size"], hf["num_attention_heads"]
    if hf.get("hidden_act", "silu") != "silu":
        refuse(where, "hidden_act", hf["hidden_act"], "SwiGLU with silu")
    head_dim = hf.get("head_dim") or head_dim_default
    if not head_dim and d % heads:
        refuse(where, "hidden_size", d, f"a multiple of num_attention_heads={heads}, or a head_dim")
    return dict(n_layers=hf["num_hidden_layers"], d_model=d, n_heads=heads,
                n_kv_heads=hf.get("num_key_value_heads") or heads, head_dim=head_dim or d // heads,
                ffn_dim=hf["intermediate_size"],
                vocab_size=hf["vocab_size"], max_seq_len=hf.get("max_position_embeddings", 2048),
                tie_embeddings=bool(hf.get("tie_word_embeddings", False)),  # LlamaConfig's and Qwen3Config's default
                norm_eps=float(hf.get("rms_norm_eps", 1e-6)), init_std=float(hf.get("initializer_range", 0.02)),
                **rope_settings(hf, where))


def from_hf_config(hf: dict, where: str) -> dict:
    for field in ("attention_bias", "mlp_bias"):
        if hf.get(field, False):
            refuse(where, field, hf[field], "Llama projections have no bias")
    return dict(arch="llama", preset="tiny", **decoder_settings(hf, where))


HF = HFMapping(architecture="LlamaForCausalLM", model_types=("llama",), to_hf_config=to_hf_config,
               from_hf_config=from_hf_config, to_hf_names=to_hf_names, from_hf_names=from_hf_names)
