"""GPT-2 <-> Hugging Face GPT2LMHeadModel: tensor names and config.json, both ways.

HF's GPT-2 uses Conv1D, whose weight is stored [in, out] (the transpose of nn.Linear), and fuses q, k, v into
one `c_attn` of shape [d, 3d]. megaloom's GPT-2 MLP is GeLU with the tanh approximation = HF's `gelu_new`.
"""

from __future__ import annotations

import torch

from megaloom.config import ModelConfig
from megaloom.errors import ConversionError
from megaloom.model_keys.shape import resolved_ffn_dim, resolved_kv_heads
from megaloom.models.family import HFMapping
from megaloom.models.hf_common import HFTensors, Tensors, refuse, refuse_head_dim

# (megaloom, HF inside transformer.h.{i}., transposed?) for everything except the fused q/k/v.
LAYER = [("attn_norm.weight", "ln_1.weight", False), ("attn_norm.bias", "ln_1.bias", False),
         ("attn.o_proj.weight", "attn.c_proj.weight", True), ("attn.o_proj.bias", "attn.c_proj.bias", False),
         ("mlp_norm.weight", "ln_2.weight", False), ("mlp_norm.bias", "ln_2.bias", False),
         ("mlp.up_proj.weight", "mlp.c_fc.weight", True), ("mlp.up_proj.bias", "mlp.c_fc.bias", False),
         ("mlp.down_proj.weight", "mlp.c_proj.weight", True),
         ("mlp.down_proj.bias", "mlp.c_proj.bias", False)]
GLOBAL = [("tok_emb.weight", "transformer.wte.weight"), ("pos_emb.weight", "transformer.wpe.weight"),
          ("norm.weight", "transformer.ln_f.weight"), ("norm.bias", "transformer.ln_f.bias")]
# HF GPT-2 activations that are exactly megaloom's F.gelu(approximate="tanh").
GELU_TANH = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")


def to_hf_names(sd: Tensors, m: ModelConfig) -> Tensors:
    out = {hf: sd[ml] for ml, hf in GLOBAL}
    for i in range(m.n_layers):
        src, dst = f"layers.{i}.", f"transformer.h.{i}."
        for ml, hf, transpose in LAYER:
            out[dst + hf] = sd[src + ml].t() if transpose else sd[src + ml]
        out[dst + "attn.c_attn.weight"] = torch.cat([sd[f"{src}attn.{p}_proj.weight"] for p in "qkv"], dim=0).t()
        out[dst + "attn.c_attn.bias"] = torch.cat([sd[f"{src}attn.{p}_proj.bias"] for p in "qkv"])
    return out


def normalize(hf: Tensors) -> Tensors:
    """Drop the causal-mask buffers some exports contain (h.i.attn.bias, masked_bias; c_attn.bias is kept) and
    add the `transformer.` prefix that checkpoints converted from the original release lack."""
    out: Tensors = {}
    for k, v in hf.items():
        if k.endswith(".attn.bias") or k.endswith(".attn.masked_bias"):
            continue
        out[k if k.startswith(("transformer.", "lm_head.")) else "transformer." + k] = v
    return out


def from_hf_names(hf: HFTensors, m: ModelConfig) -> Tensors:
    sd = {ml: hf.take(name) for ml, name in GLOBAL}
    for i in range(m.n_layers):
        src, dst = f"transformer.h.{i}.", f"layers.{i}."
        for ml, name, transpose in LAYER:
            t = hf.take(src + name)
            sd[dst + ml] = t.t() if transpose else t
        for part, w, b in zip("qkv", hf.take(src + "attn.c_attn.weight").t().chunk(3, dim=0),
                              hf.take(src + "attn.c_attn.bias").chunk(3), strict=True):
            sd[f"{dst}attn.{part}_proj.weight"] = w
            sd[f"{dst}attn.{part}_proj.bias"] = b
    return sd


def to_hf_config(m: ModelConfig) -> dict:
    kv = resolved_kv_heads(m)
    if kv != m.n_heads:
        raise ConversionError(f"model.n_kv_heads={kv} with arch gpt2: GPT2LMHeadModel has no grouped-query "
                              f"attention; only n_kv_heads=0 or {m.n_heads} can be exported.")
    refuse_head_dim(m, "GPT2LMHeadModel")
    return {"n_embd": m.d_model, "n_layer": m.n_layers, "n_head": m.n_heads, "n_positions": m.max_seq_len,
            "n_inner": resolved_ffn_dim(m), "layer_norm_epsilon": m.norm_eps, "activation_function": "gelu_new",
            "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
            "attn_pdrop": 0.0, "embd_pdrop": 0.0, "resid_pdrop": 0.0}


def from_hf_config(hf: dict, where: str) -> dict:
    act = hf.get("activation_function", "gelu_new")
    if act not in GELU_TANH:
        refuse(where, "activation_function", act, f"GeLU with the tanh approximation: {', '.join(GELU_TANH)}")
    for field, ok in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                      ("add_cross_attention", False)):
        if hf.get(field, ok) != ok:
            refuse(where, field, hf[field], f"only {ok}")
    d, heads = hf["n_embd"], hf["n_head"]
    if d % heads:
        refuse(where, "n_embd", d, f"a multiple of n_head={heads}")
    return dict(arch="gpt2", preset="tiny-gpt2", n_layers=hf["n_layer"], d_model=d, n_heads=heads, n_kv_heads=heads,
                ffn_dim=hf.get("n_inner") or 4 * d, vocab_size=hf["vocab_size"], max_seq_len=hf["n_positions"],
                tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
                norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)), init_std=float(hf.get("initializer_range", 0.02)))


HF = HFMapping(architecture="GPT2LMHeadModel", model_types=("gpt2",), to_hf_config=to_hf_config,
               from_hf_config=from_hf_config, to_hf_names=to_hf_names, from_hf_names=from_hf_names,
               normalize=normalize)
