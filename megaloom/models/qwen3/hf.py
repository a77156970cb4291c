"""Qwen3 <-> Hugging Face Qwen3ForCausalLM: tensor names and config.json, both ways.

Qwen3ForCausalLM is Llama's layout (transformers derives it from Llama) plus the QK-norm weights
``self_attn.q_norm.weight`` / ``self_attn.k_norm.weight``, so names and the shared config fields come from
`megaloom.models.llama.hf`. Refused with the field named: ``attention_bias=true`` (HF then puts biases on
all four attention projections, o_proj included; megaloom's ``model.qkv_bias`` is on q/k/v only, so such a
model cannot be exported either) and sliding-window layers. head_dim is read into model.head_dim (Qwen3Config's
default is 128 when config.json has none), so 0.6B, 4B and 32B, whose heads are wider than hidden_size /
num_attention_heads, import.
"""

from __future__ import annotations

from megaloom.config import ModelConfig
from megaloom.errors import ConversionError
from megaloom.models.family import HFMapping
from megaloom.models.hf_common import HFTensors, Tensors, refuse
from megaloom.models.llama import hf as llama_hf

LAYER = [*llama_hf.LAYER, ("attn.q_norm.weight", "self_attn.q_norm.weight"),
         ("attn.k_norm.weight", "self_attn.k_norm.weight")]
QWEN3_HEAD_DIM = 128  # Qwen3Config's default


def to_hf_names(sd: Tensors, m: ModelConfig) -> Tensors:
    return llama_hf.to_hf_names(sd, m, LAYER)


def from_hf_names(hf: HFTensors, m: ModelConfig) -> Tensors:
    return llama_hf.from_hf_names(hf, m, LAYER)


def to_hf_config(m: ModelConfig) -> dict:
    if m.qkv_bias:
        raise ConversionError("model.qkv_bias=true: Qwen3ForCausalLM's attention_bias puts biases on all four "
                              "attention projections (o_proj too), so q/k/v-only biases cannot be expressed. Only "
                              "models trained with model.qkv_bias=false can be exported as Qwen3.")
    return {**llama_hf.decoder_config(m), "use_sliding_window": False, "sliding_window": None,
            "max_window_layers": m.n_layers, "layer_types": ["full_attention"] * m.n_layers}


def from_hf_config(hf: dict, where: str) -> dict:
    if hf.get("attention_bias", False):
        refuse(where, "attention_bias", hf["attention_bias"], "HF Qwen3 then has biases on q, k, v and o_proj; "
               "megaloom's qwen3 has none, or q/k/v-only biases with model.qkv_bias")
    if hf.get("use_sliding_window", False):
        refuse(where, "use_sliding_window", hf["use_sliding_window"], "full attention in every layer only")
    layer_types = hf.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types):
        refuse(where, "layer_types", sorted(set(layer_types)), "'full_attention' in every layer only")
    return dict(arch="qwen3", preset="qwen3-tiny",
                **llama_hf.decoder_settings(hf, where, head_dim_default=QWEN3_HEAD_DIM))


HF = HFMapping(architecture="Qwen3ForCausalLM", model_types=("qwen3",), to_hf_config=to_hf_config,
               from_hf_config=from_hf_config, to_hf_names=to_hf_names, from_hf_names=from_hf_names)
