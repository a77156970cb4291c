"""Tensor names and layouts: megaloom state dicts <-> Hugging Face LlamaForCausalLM / GPT2LMHeadModel.

Llama needs renaming only: megaloom's RoPE already uses the rotate-half layout of HF's Llama, so q/k
projections need no permutation (tests compare logits). GPT-2 in HF uses Conv1D, whose weight is stored
[in, out] (the transpose of nn.Linear), and fuses q, k, v into one `c_attn` of shape [d, 3d].
Tied embeddings: the head is not written (HF ties lm_head to the embedding itself) and is read from the
embedding on import.
"""

from __future__ import annotations

import torch

from megaloom.convert.errors import ConversionError

Tensors = dict[str, torch.Tensor]

# (megaloom name inside layers.{i}., HF name inside model.layers.{i}.)
_LLAMA_LAYER = [("attn_norm.weight", "input_layernorm.weight"),
                ("attn.q_proj.weight", "self_attn.q_proj.weight"),
                ("attn.k_proj.weight", "self_attn.k_proj.weight"),
                ("attn.v_proj.weight", "self_attn.v_proj.weight"),
                ("attn.o_proj.weight", "self_attn.o_proj.weight"),
                ("mlp_norm.weight", "post_attention_layernorm.weight"),
                ("mlp.gate_proj.weight", "mlp.gate_proj.weight"),
                ("mlp.up_proj.weight", "mlp.up_proj.weight"),
                ("mlp.down_proj.weight", "mlp.down_proj.weight")]
_LLAMA_GLOBAL = [("tok_emb.weight", "model.embed_tokens.weight"), ("norm.weight", "model.norm.weight")]

# GPT-2: (megaloom, HF inside transformer.h.{i}., transposed?) for everything except the fused q/k/v.
_GPT2_LAYER = [("attn_norm.weight", "ln_1.weight", False), ("attn_norm.bias", "ln_1.bias", False),
               ("attn.o_proj.weight", "attn.c_proj.weight", True), ("attn.o_proj.bias", "attn.c_proj.bias", False),
               ("mlp_norm.weight", "ln_2.weight", False), ("mlp_norm.bias", "ln_2.bias", False),
               ("mlp.up_proj.weight", "mlp.c_fc.weight", True), ("mlp.up_proj.bias", "mlp.c_fc.bias", False),
               ("mlp.down_proj.weight", "mlp.c_proj.weight", True),
               ("mlp.down_proj.bias", "mlp.c_proj.bias", False)]
_GPT2_GLOBAL = [("tok_emb.weight", "transformer.wte.weight"), ("pos_emb.weight", "transformer.wpe.weight"),
                ("norm.weight", "transformer.ln_f.weight"), ("norm.bias", "transformer.ln_f.bias")]


def to_hf_names(arch: str, sd: Tensors, n_layers: int, tied: bool) -> Tensors:
    """megaloom full state dict -> HF tensors (contiguous; transposed / fused where HF's layout differs)."""
    out: Tensors = {}
    if arch == "llama":
        for ml, hf in _LLAMA_GLOBAL:
            out[hf] = sd[ml]
        for i in range(n_layers):
            for ml, hf in _LLAMA_LAYER:
                out[f"model.layers.{i}.{hf}"] = sd[f"layers.{i}.{ml}"]
    else:
        for ml, hf in _GPT2_GLOBAL:
            out[hf] = sd[ml]
        for i in range(n_layers):
            src, dst = f"layers.{i}.", f"transformer.h.{i}."
            for ml, hf, transpose in _GPT2_LAYER:
                out[dst + hf] = sd[src + ml].t() if transpose else sd[src + ml]
            qkv = [sd[f"{src}attn.{p}_proj.weight"] for p in "qkv"]
            out[dst + "attn.c_attn.weight"] = torch.cat(qkv, dim=0).t()
            out[dst + "attn.c_attn.bias"] = torch.cat([sd[f"{src}attn.{p}_proj.bias"] for p in "qkv"])
    if not tied:
        out["lm_head.weight"] = sd["head.weight"]
    return {k: v.contiguous() for k, v in out.items()}


def _normalise_hf(arch: str, hf: Tensors) -> Tensors:
    """Drop buffers some exports contain (causal masks, rotary tables) and add GPT-2's `transformer.` prefix
    that checkpoints converted from the original release lack."""
    out: Tensors = {}
    for k, v in hf.items():
        if arch == "gpt2" and (k.endswith(".attn.bias") or k.endswith(".attn.masked_bias")):
            continue  # the causal-mask buffer (h.i.attn.bias), not a parameter; c_attn.bias is kept
        if k.endswith("rotary_emb.inv_freq"):
            continue
        if arch == "gpt2" and not k.startswith(("transformer.", "lm_head.")):
            k = "transformer." + k
        out[k] = v
    return out


def from_hf_names(arch: str, hf: Tensors, n_layers: int, tied: bool, where: str) -> Tensors:
    """HF tensors -> megaloom full state dict (fp32 views/copies). Missing or unexpected tensors are refused,
    naming them, so a model of another layout never loads half-way."""
    hf = _normalise_hf(arch, hf)
    used: set[str] = set()

    def take(name: str) -> torch.Tensor:
        if name not in hf:
            raise ConversionError(f"{where}: tensor {name!r} is missing (a {arch} model with {n_layers} layers "
                                  "needs it); is the config.json from the same model as the weights?")
        used.add(name)
        return hf[name]

    sd: Tensors = {}
    if arch == "llama":
        for ml, name in _LLAMA_GLOBAL:
            sd[ml] = take(name)
        for i in range(n_layers):
            for ml, name in _LLAMA_LAYER:
                sd[f"layers.{i}.{ml}"] = take(f"model.layers.{i}.{name}")
    else:
        for ml, name in _GPT2_GLOBAL:
            sd[ml] = take(name)
        for i in range(n_layers):
            src, dst = f"transformer.h.{i}.", f"layers.{i}."
            for ml, name, transpose in _GPT2_LAYER:
                t = take(src + name)
                sd[dst + ml] = t.t() if transpose else t
            for part, w, b in zip("qkv", take(src + "attn.c_attn.weight").t().chunk(3, dim=0),
                                  take(src + "attn.c_attn.bias").chunk(3), strict=True):
                sd[f"{dst}attn.{part}_proj.weight"] = w
                sd[f"{dst}attn.{part}_proj.bias"] = b
    if tied:
        sd["head.weight"] = sd["tok_emb.weight"]
        used.add("lm_head.weight")  # some exports write the tied head too; HF ignores it, and so do we
    else:
        sd["head.weight"] = take("lm_head.weight")
    extra = sorted(set(hf) - used)
    if extra:
        shown = ", ".join(extra[:5]) + (f" and {len(extra) - 5} more" if len(extra) > 5 else "")
        raise ConversionError(f"{where}: unexpected tensors {shown}; megaloom's {arch} model has no such "
                              "parameters (is num_hidden_layers / n_layer right, or is this another architecture?)")
    return {k: v.float().contiguous() for k, v in sd.items()}
