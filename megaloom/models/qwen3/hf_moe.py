"""Qwen3 with Mixture-of-Experts layers <-> Hugging Face Qwen3MoeForCausalLM: tensor names and config.json.

Qwen3-MoE is Qwen3's attention (QK-norm) and norms with, in blocks i where (i + 1) % ``decoder_sparse_step`` == 0,
a softmax top-k router over ``num_experts`` SwiGLU experts of width ``moe_intermediate_size``, and a dense MLP of
``intermediate_size`` in the others: megaloom's ``model.moe_every`` = decoder_sparse_step (the same rule),
``model.expert_ffn_dim`` = moe_intermediate_size, ``model.ffn_dim`` = intermediate_size. Tensors: the router
``model.layers.<i>.mlp.gate.weight`` and the experts ``...mlp.experts.<j>.gate_proj/up_proj/down_proj.weight`` (the
Hub's layout; transformers 5's stacked experts are read too, `megaloom.convert.hf_moe`). ``norm_topk_prob`` (the
chosen weights renormalised; Qwen3MoeConfig's default false, the released models true) is
``model.moe_norm_topk``. Refused by name: ``mlp_only_layers`` (dense
blocks outside the decoder_sparse_step rule), shared experts, sigmoid routers and a trained aux-loss-free bias
(export), and what Qwen3 refuses. The released Qwen3-30B-A3B and -235B-A22B have head_dim 128 != hidden_size /
num_attention_heads: it is read into model.head_dim, as for the dense models.
"""

from __future__ import annotations

from megaloom.config import ModelConfig
from megaloom.models.family import HFMapping
from megaloom.models.hf_common import HFTensors, Tensors, refuse
from megaloom.models.hf_moe import moe_layer_from_hf, moe_layer_to_hf
from megaloom.models.llama import hf as llama_hf
from megaloom.models.llama.hf_mixtral import check_moe_exportable, expert_width
from megaloom.models.qwen3 import hf as qwen3_hf

ATTENTION = [(ml, hf) for ml, hf in qwen3_hf.LAYER if not ml.startswith("mlp.")]
DENSE = [(ml, hf) for ml, hf in qwen3_hf.LAYER if ml.startswith("mlp.")]
EXPERTS = ("gate_proj", "up_proj", "down_proj")


def is_moe_layer(m: ModelConfig, i: int) -> bool:
    return bool(m.moe_every) and (i + 1) % m.moe_every == 0


def to_hf_names(sd: Tensors, m: ModelConfig) -> Tensors:
    out = {hf: sd[ml] for ml, hf in llama_hf.GLOBAL}
    for i in range(m.n_layers):
        for ml, hf in ATTENTION + ([] if is_moe_layer(m, i) else DENSE):
            out[f"model.layers.{i}.{hf}"] = sd[f"layers.{i}.{ml}"]
        if is_moe_layer(m, i):
            out.update(moe_layer_to_hf(sd, i, f"model.layers.{i}.mlp", EXPERTS))
    return out


def from_hf_names(hf: HFTensors, m: ModelConfig) -> Tensors:
    sd = {ml: hf.take(name) for ml, name in llama_hf.GLOBAL}
    for i in range(m.n_layers):
        for ml, name in ATTENTION + ([] if is_moe_layer(m, i) else DENSE):
            sd[f"layers.{i}.{ml}"] = hf.take(f"model.layers.{i}.{name}")
        if is_moe_layer(m, i):
            sd.update(moe_layer_from_hf(hf, i, (f"model.layers.{i}.mlp",), EXPERTS, m.n_experts))
    return sd


def to_hf_config(m: ModelConfig) -> dict:
    check_moe_exportable(m, "Qwen3MoeForCausalLM")
    return {**qwen3_hf.to_hf_config(m), "decoder_sparse_step": m.moe_every, "mlp_only_layers": [],
            "num_experts": m.n_experts, "num_experts_per_tok": m.top_k, "moe_intermediate_size": expert_width(m),
            "norm_topk_prob": m.moe_norm_topk, "router_aux_loss_coef": m.aux_loss_weight, "output_router_logits": False}


def from_hf_config(hf: dict, where: str) -> dict:
    settings = qwen3_hf.from_hf_config(hf, where)
    if hf.get("mlp_only_layers"):
        refuse(where, "mlp_only_layers", hf["mlp_only_layers"], "MoE in every block the decoder_sparse_step rule "
               "names ([] only)")
    n_experts = hf.get("num_experts", hf.get("num_local_experts"))
    if not n_experts:
        refuse(where, "num_experts", n_experts, "at least one expert (a model without experts is a qwen3)")
    step = hf.get("decoder_sparse_step", 1)
    if not isinstance(step, int) or step < 1:
        refuse(where, "decoder_sparse_step", step, "an integer >= 1 (MoE in blocks i with (i + 1) % step == 0)")
    return {**settings, "moe_every": step, "n_experts": int(n_experts),
            "top_k": int(hf["num_experts_per_tok"]), "n_shared_experts": 0,
            "expert_ffn_dim": int(hf["moe_intermediate_size"]), "router_score": "softmax",
            # Qwen3MoeConfig's default is false; the released models set true
            "moe_norm_topk": bool(hf.get("norm_topk_prob", False)),
            "aux_loss_weight": float(hf.get("router_aux_loss_coef", 0.001)), "z_loss_weight": 0.0,
            "capacity_factor": 0.0, "aux_free_bias_rate": 0.0}


HF = HFMapping(architecture="Qwen3MoeForCausalLM", model_types=("qwen3_moe",), to_hf_config=to_hf_config,
               from_hf_config=from_hf_config, to_hf_names=to_hf_names, from_hf_names=from_hf_names)
