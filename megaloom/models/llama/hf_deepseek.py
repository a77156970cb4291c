"""Llama with latent attention <-> Hugging Face DeepseekV3ForCausalLM: tensor names and config.json, both ways.

A llama model with ``model.attention=mla`` is a DeepSeek-V3: the attention is renamed (``kv_a_proj`` is HF's
``kv_a_proj_with_mqa``, ``q_a_norm`` / ``kv_a_norm`` its ``*_a_layernorm``), the blocks before
``model.first_dense_layers`` (HF's first_k_dense_replace) keep a dense SwiGLU of ``ffn_dim`` and the rest are MoE
layers: the sigmoid router ``mlp.gate.weight`` with its selection bias ``mlp.gate.e_score_correction_bias``
(megaloom's aux-loss-free ``router.expert_bias``: added to the scores to choose experts, not to weight them), the
experts ``mlp.experts.<j>.{gate,up,down}_proj`` (the Hub's layout; transformers 5's stacked one is read too) and
the shared experts ``mlp.shared_experts.*`` (megaloom's ``mlp.shared``). Routing maps field by field:
n_group / topk_group (group-limited top-k) = model.n_expert_groups / topk_groups, routed_scaling_factor, and
norm_topk_prob = model.moe_norm_topk (DeepSeek-V3 as released: true; false weights the experts by their raw sigmoid
scores times routed_scaling_factor, as transformers does). A dense model (model.moe_every=0) is written
with first_k_dense_replace = num_hidden_layers.

RoPE: DeepSeek's checkpoints keep each head's rotary dimensions in interleaved pairs (rope_interleave, HF's
default true), megaloom rotates halves; the pair (2i, 2i+1) of the rows of q_b_proj's (or q_proj's) rope part and
of kv_a_proj's rope rows is (i, i + r/2) here, so import and export permute those rows (exact) and export writes
rope_interleave=true, the layout other DeepSeek tools read (a config.json with rope_interleave=false is
refused). YaRN: HF's mscale / mscale_all_dim become model.rope_attention_factor (the cos/sin scale:
mscale(f, mscale) / mscale(f, mscale_all_dim)) and model.rope_mscale_all_dim (the softmax scale's mscale^2).

Multi-token prediction (model.mtp_depth): export writes each module in DeepSeek's layout as layer
``model.layers.<num_hidden_layers + k>`` (its block's tensors, ``enorm``, ``hnorm``, ``eh_proj``,
``shared_head.norm``, and copies of the shared ``embed_tokens`` and ``shared_head.head``) with
num_nextn_predict_layers; transformers does not build these layers and ignores them, and import skips them too
(the imported run has model.mtp_depth=0; set it to train new modules). Not carried: training-time fields
(aux_loss_alpha, seq_aux, scoring_func / topk_method, which transformers ignores: it always routes by sigmoid with
the group limit).
Refused by name: num_key_value_heads != num_attention_heads, attention_bias, an MoE layer in only some blocks after
the dense ones (model.moe_every > 1), no shared expert, softmax routers.
"""

from __future__ import annotations

import math

import torch

from megaloom.config import ModelConfig
from megaloom.errors import ConversionError
from megaloom.model_keys.shape import resolved_expert_ffn_dim, resolved_ffn_dim
from megaloom.models.family import HFMapping
from megaloom.models.hf_common import HFTensors, Tensors, _rope_parameters, refuse, rope_config, rope_settings
from megaloom.models.hf_moe import moe_layer_from_hf, moe_layer_to_hf
from megaloom.models.layers import yarn_default_attention_factor
from megaloom.models.llama import hf as llama_hf
from megaloom.models.moe import is_moe_block

EXPERTS = ("gate_proj", "up_proj", "down_proj")
NORMS = [("attn_norm.weight", "input_layernorm.weight"), ("mlp_norm.weight", "post_attention_layernorm.weight")]
DENSE = [(f"mlp.{n}.weight", f"mlp.{n}.weight") for n in EXPERTS]
SHARED = [(f"mlp.shared.{n}.weight", f"mlp.shared_experts.{n}.weight") for n in EXPERTS]


def attention_names(m: ModelConfig) -> list[tuple[str, str]]:
    q = ([("attn.q_a_proj.weight", "self_attn.q_a_proj.weight"),
          ("attn.q_a_norm.weight", "self_attn.q_a_layernorm.weight"),
          ("attn.q_b_proj.weight", "self_attn.q_b_proj.weight")] if m.q_lora_rank
         else [("attn.q_proj.weight", "self_attn.q_proj.weight")])
    return q + [("attn.kv_a_proj.weight", "self_attn.kv_a_proj_with_mqa.weight"),
                ("attn.kv_a_norm.weight", "self_attn.kv_a_layernorm.weight"),
                ("attn.kv_b_proj.weight", "self_attn.kv_b_proj.weight"),
                ("attn.o_proj.weight", "self_attn.o_proj.weight")]


def _rope_rows(m: ModelConfig, name: str, rows: int) -> torch.Tensor | None:
    """Row indices of weight ``name`` with each head's rope part in rotate-half order, taken from the interleaved
    order (index i of the result: the interleaved row it comes from); None for a weight without rope rows."""
    r = m.qk_rope_head_dim
    half = torch.cat([torch.arange(0, r, 2), torch.arange(1, r, 2)])  # rotate-half slot j <- interleaved row
    idx = torch.arange(rows)
    if name.endswith(("q_b_proj.weight", "q_proj.weight")):
        qk = m.qk_nope_head_dim + r
        for h in range(rows // qk):
            start = h * qk + m.qk_nope_head_dim
            idx[start:start + r] = start + half
        return idx
    if name.endswith("kv_a_proj.weight"):
        idx[m.kv_lora_rank:] = m.kv_lora_rank + half
        return idx
    return None


def _from_interleaved(m: ModelConfig, name: str, w: torch.Tensor) -> torch.Tensor:
    idx = _rope_rows(m, name, w.shape[0])
    return w if idx is None else w[idx]


def _to_interleaved(m: ModelConfig, name: str, w: torch.Tensor) -> torch.Tensor:
    idx = _rope_rows(m, name, w.shape[0])
    return w if idx is None else w[torch.argsort(idx)]


def _block_to_hf(sd: Tensors, m: ModelConfig, ml: str, i: int, pre: str) -> Tensors:
    """Block ``ml`` (``layers.i`` or an MTP module's ``mtp.k.block``, as block index ``i``) under HF's ``pre``."""
    out = {f"{pre}.{hf}": _to_interleaved(m, name, sd[f"{ml}.{name}"]) for name, hf in NORMS + attention_names(m)}
    if not is_moe_block(m, i):
        return {**out, **{f"{pre}.{hf}": sd[f"{ml}.{name}"] for name, hf in DENSE}}
    moe = {k.replace(f"{ml}.", f"layers.{i}.", 1): v for k, v in sd.items() if k.startswith(f"{ml}.mlp.")}
    bias = f"layers.{i}.mlp.router.expert_bias"  # the selection bias has a name here: not refused, written
    out.update(moe_layer_to_hf({**moe, bias: torch.zeros_like(moe[bias])}, i, f"{pre}.mlp", EXPERTS))
    out[f"{pre}.mlp.gate.e_score_correction_bias"] = moe[bias]
    return {**out, **{f"{pre}.{hf}": sd[f"{ml}.{name}"] for name, hf in SHARED}}


def to_hf_names(sd: Tensors, m: ModelConfig) -> Tensors:
    out = {hf: sd[ml] for ml, hf in llama_hf.GLOBAL}
    for i in range(m.n_layers):
        out.update(_block_to_hf(sd, m, f"layers.{i}", i, f"model.layers.{i}"))
    for k in range(m.mtp_depth):  # DeepSeek's layout of its MTP layers, after the main ones (module doc)
        i, ml = m.n_layers + k, f"mtp.{k}"
        pre = f"model.layers.{i}"
        out.update(_block_to_hf(sd, m, f"{ml}.block", i, pre))
        out.update({f"{pre}.{n}.weight": sd[f"{ml}.{n}.weight"] for n in ("enorm", "hnorm", "eh_proj")})
        out[f"{pre}.shared_head.norm.weight"] = sd[f"{ml}.norm.weight"]
        # shared with the model, stored again per layer (copies: safetensors refuses tensors sharing memory)
        out[f"{pre}.embed_tokens.weight"] = sd["tok_emb.weight"].clone()
        out[f"{pre}.shared_head.head.weight"] = sd["head.weight"].clone()
    return out


def from_hf_names(hf: HFTensors, m: ModelConfig) -> Tensors:
    sd = {ml: hf.take(name) for ml, name in llama_hf.GLOBAL}
    for i in range(m.n_layers):
        pre = f"model.layers.{i}"
        for ml, name in NORMS + attention_names(m):
            sd[f"layers.{i}.{ml}"] = _from_interleaved(m, ml, hf.take(f"{pre}.{name}"))
        if not is_moe_block(m, i):
            sd.update({f"layers.{i}.{ml}": hf.take(f"{pre}.{name}") for ml, name in DENSE})
            continue
        sd.update(moe_layer_from_hf(hf, i, (f"{pre}.mlp",), EXPERTS, m.n_experts))
        sd[f"layers.{i}.mlp.router.expert_bias"] = hf.take(f"{pre}.mlp.gate.e_score_correction_bias").float()
        sd.update({f"layers.{i}.{ml}": hf.take(f"{pre}.{name}") for ml, name in SHARED})
    for name in hf.tensors:  # multi-token-prediction layers after the main ones: not part of megaloom's model
        parts = name.split(".")
        if name.startswith("model.layers.") and parts[2].isdigit() and int(parts[2]) >= m.n_layers:
            hf.ignore(name)
    return sd


def to_hf_config(m: ModelConfig) -> dict:
    if m.qkv_bias:
        raise ConversionError("model.qkv_bias=true: DeepseekV3ForCausalLM's latent attention has no q/k/v biases. "
                              "Only models trained with model.qkv_bias=false can be exported.")
    moe = bool(m.moe_every)
    if moe:
        if m.moe_every != 1:
            raise ConversionError(f"model.moe_every={m.moe_every}: DeepseekV3ForCausalLM has an MoE layer in every "
                                  "block after the first model.first_dense_layers. Only model.moe_every=1 (or 0) can "
                                  "be exported.")
        if m.router_score != "sigmoid":
            raise ConversionError(f"model.router_score={m.router_score}: DeepseekV3ForCausalLM routes by sigmoid "
                                  "scores. Only models trained with model.router_score=sigmoid can be exported.")
        if not m.n_shared_experts:
            raise ConversionError("model.n_shared_experts=0: every MoE layer of DeepseekV3ForCausalLM has shared "
                                  "experts. Only models with model.n_shared_experts >= 1 can be exported.")
    expert_width = resolved_expert_ffn_dim(m)
    rope = rope_config(m)
    if m.rope_scaling == "yarn":  # DeepSeek's softmax mscale (HF's yarn_apply_mscale reads it here)
        for key in ("rope_scaling", "rope_parameters"):
            rope[key] = {**rope[key], "mscale_all_dim": m.rope_mscale_all_dim}
    return {"hidden_size": m.d_model, "intermediate_size": resolved_ffn_dim(m), "num_hidden_layers": m.n_layers,
            "num_attention_heads": m.n_heads, "num_key_value_heads": m.n_heads, "rms_norm_eps": m.norm_eps,
            "max_position_embeddings": m.max_seq_len, "hidden_act": "silu", "attention_bias": False,
            "attention_dropout": 0.0, **rope, "rope_interleave": True,
            "q_lora_rank": m.q_lora_rank or None, "kv_lora_rank": m.kv_lora_rank,
            "qk_nope_head_dim": m.qk_nope_head_dim, "qk_rope_head_dim": m.qk_rope_head_dim,
            "v_head_dim": m.v_head_dim, "first_k_dense_replace": m.first_dense_layers if moe else m.n_layers,
            "n_routed_experts": m.n_experts, "num_experts_per_tok": m.top_k, "moe_intermediate_size": expert_width,
            "n_shared_experts": m.n_shared_experts if moe else 1, "n_group": m.n_expert_groups,
            "topk_group": m.topk_groups, "routed_scaling_factor": m.routed_scaling_factor,
            "norm_topk_prob": m.moe_norm_topk,
            "num_nextn_predict_layers": m.mtp_depth, "output_router_logits": False}


def _mscale(factor: float, mscale: float) -> float:
    """YaRN's 0.1 * mscale * ln(factor) + 1 (1 for factor <= 1)."""
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def _rope(hf: dict, where: str) -> dict:
    """model.rope_* of a DeepSeek config.json: YaRN's mscale / mscale_all_dim taken apart (module doc)."""
    params = _rope_parameters(hf, where)
    mscale, mscale_all = params.pop("mscale", None), params.pop("mscale_all_dim", None)
    plain = {k: v for k, v in hf.items() if k not in ("rope_scaling", "rope_parameters")}
    out = rope_settings({**plain, "rope_parameters": params}, where)
    if out.get("rope_scaling") == "yarn":
        f = out["rope_factor"]
        if params.get("attention_factor") is None:  # transformers' yarn: the ratio of the two mscales
            out["rope_attention_factor"] = (_mscale(f, mscale) / _mscale(f, mscale_all) if mscale and mscale_all
                                            else yarn_default_attention_factor(f))
        out["rope_mscale_all_dim"] = float(mscale_all or 0.0)
    return out


def from_hf_config(hf: dict, where: str) -> dict:
    d, heads, n_layers = hf["hidden_size"], hf["num_attention_heads"], hf["num_hidden_layers"]
    if hf.get("hidden_act", "silu") != "silu":
        refuse(where, "hidden_act", hf["hidden_act"], "SwiGLU with silu")
    if hf.get("attention_bias", False):
        refuse(where, "attention_bias", hf["attention_bias"], "latent attention without biases")
    if (hf.get("num_key_value_heads") or heads) != heads:
        refuse(where, "num_key_value_heads", hf["num_key_value_heads"], f"num_attention_heads={heads}: every head "
               "expands keys and values from the shared latent")
    if not hf.get("rope_interleave", True):
        refuse(where, "rope_interleave", False, "DeepSeek's interleaved rotary rows (true, transformers' default), "
               "which import turns into megaloom's rotate-half layout")
    dense_first = hf.get("first_k_dense_replace", 3)
    moe = dense_first < n_layers
    n_experts = hf.get("n_routed_experts", hf.get("num_local_experts", 256))
    if moe and not hf.get("n_shared_experts"):
        refuse(where, "n_shared_experts", hf.get("n_shared_experts"), "at least one shared expert")
    return dict(arch="llama", preset="deepseek-v3-tiny", n_layers=n_layers, d_model=d, n_heads=heads, n_kv_heads=heads,
                ffn_dim=hf["intermediate_size"], vocab_size=hf["vocab_size"],
                max_seq_len=hf.get("max_position_embeddings", 4096),
                tie_embeddings=bool(hf.get("tie_word_embeddings", False)), norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                init_std=float(hf.get("initializer_range", 0.02)), **_rope(hf, where), attention="mla",
                q_lora_rank=hf.get("q_lora_rank") or 0, kv_lora_rank=hf["kv_lora_rank"],
                qk_nope_head_dim=hf["qk_nope_head_dim"], qk_rope_head_dim=hf["qk_rope_head_dim"],
                v_head_dim=hf["v_head_dim"], moe_every=1 if moe else 0, first_dense_layers=dense_first if moe else 0,
                n_experts=n_experts, top_k=hf.get("num_experts_per_tok", 8), n_shared_experts=hf.get("n_shared_experts")
                or 0, expert_ffn_dim=hf.get("moe_intermediate_size", 0), router_score="sigmoid",
                n_expert_groups=hf.get("n_group") or 1, topk_groups=hf.get("topk_group") or 1,
                routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
                moe_norm_topk=bool(hf.get("norm_topk_prob", True)),  # DeepseekV3Config's default
                aux_loss_weight=float(hf.get("aux_loss_alpha", 0.0)), z_loss_weight=0.0, capacity_factor=0.0,
                aux_free_bias_rate=0.0)


HF = HFMapping(architecture="DeepseekV3ForCausalLM", model_types=("deepseek_v3",), to_hf_config=to_hf_config,
               from_hf_config=from_hf_config, to_hf_names=to_hf_names, from_hf_names=from_hf_names)
