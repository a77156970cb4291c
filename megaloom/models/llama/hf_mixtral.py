"""Llama with Mixture-of-Experts layers <-> Hugging Face MixtralForCausalLM: tensor names and config.json.

A llama model with ``model.moe_every=1`` (every block's MLP an MoE layer) is a Mixtral: the same attention and
norms as Llama, and per layer a softmax top-k router whose chosen weights are renormalised (megaloom's softmax
router does the same) over ``num_local_experts`` SwiGLU experts of width ``intermediate_size``. Tensors: the router
``model.layers.<i>.block_sparse_moe.gate.weight`` and the experts ``...block_sparse_moe.experts.<j>.w1/w3/w2.weight``
(gate, up, down), the Hub's layout; transformers 5's in-memory layout (``.mlp.`` and stacked experts) is read too
(`megaloom.convert.hf_moe`). Refused by name: MoE only in some blocks (``model.moe_every`` > 1), shared experts,
sigmoid routers, a trained aux-loss-free bias, model.moe_norm_topk=false (export); sliding-window attention
(import). HF's ``router_jitter_noise`` (training-time noise) is not carried over; ``router_aux_loss_coef`` <->
``model.aux_loss_weight``.
"""

from __future__ import annotations

from megaloom.config import ModelConfig
from megaloom.errors import ConversionError
from megaloom.model_keys.shape import resolved_expert_ffn_dim
from megaloom.models.family import HFMapping
from megaloom.models.hf_common import HFTensors, Tensors, refuse
from megaloom.models.hf_moe import moe_layer_from_hf, moe_layer_to_hf
from megaloom.models.llama import hf as llama_hf

ATTENTION = [(ml, hf) for ml, hf in llama_hf.LAYER if not ml.startswith("mlp.")]
EXPERTS = ("w1", "w3", "w2")  # gate, up, down


def expert_width(m: ModelConfig) -> int:
    return resolved_expert_ffn_dim(m)


def check_moe_exportable(m: ModelConfig, architecture: str) -> None:
    """What neither Mixtral nor Qwen3-MoE can express: shared experts and sigmoid routers."""
    if m.n_shared_experts:
        raise ConversionError(f"model.n_shared_experts={m.n_shared_experts}: Hugging Face's {architecture} has no "
                              "shared experts. Only MoE models trained with model.n_shared_experts=0 can be exported.")
    if m.router_score != "softmax":
        raise ConversionError(f"model.router_score={m.router_score}: Hugging Face's {architecture} routes by "
                              "softmax. Only MoE models trained with model.router_score=softmax can be exported.")
    for key, value, plain in (("first_dense_layers", m.first_dense_layers, 0),
                              ("n_expert_groups", m.n_expert_groups, 1),
                              ("routed_scaling_factor", m.routed_scaling_factor, 1.0)):
        if value != plain:
            raise ConversionError(f"model.{key}={value}: Hugging Face's {architecture} has no such setting (DeepSeek's "
                                  f"routing). Only MoE models trained with model.{key}={plain} can be exported.")


def to_hf_names(sd: Tensors, m: ModelConfig) -> Tensors:
    out = {hf: sd[ml] for ml, hf in llama_hf.GLOBAL}
    for i in range(m.n_layers):
        for ml, hf in ATTENTION:
            out[f"model.layers.{i}.{hf}"] = sd[f"layers.{i}.{ml}"]
        out.update(moe_layer_to_hf(sd, i, f"model.layers.{i}.block_sparse_moe", EXPERTS))
    return out


def from_hf_names(hf: HFTensors, m: ModelConfig) -> Tensors:
    sd = {ml: hf.take(name) for ml, name in llama_hf.GLOBAL}
    for i in range(m.n_layers):
        for ml, name in ATTENTION:
            sd[f"layers.{i}.{ml}"] = hf.take(f"model.layers.{i}.{name}")
        sd.update(moe_layer_from_hf(hf, i, (f"model.layers.{i}.block_sparse_moe", f"model.layers.{i}.mlp"),
                                    EXPERTS, m.n_experts))
    return sd


def to_hf_config(m: ModelConfig) -> dict:
    llama_hf.to_hf_config(m)  # the same attention refusals (q/k/v-only biases)
    if m.moe_every != 1:
        raise ConversionError(f"model.moe_every={m.moe_every}: Hugging Face's MixtralForCausalLM has an MoE layer in "
                              "every block. Only llama MoE models trained with model.moe_every=1 can be exported.")
    check_moe_exportable(m, "MixtralForCausalLM")
    if not m.moe_norm_topk:
        raise ConversionError("model.moe_norm_topk=false: Hugging Face's MixtralForCausalLM always renormalises the "
                              "chosen experts' weights. Only models trained with model.moe_norm_topk=true can be "
                              "exported (Qwen3MoeForCausalLM's norm_topk_prob=false can express it).")
    cfg = llama_hf.decoder_config(m)
    cfg.pop("attention_bias")
    return {**cfg, "intermediate_size": expert_width(m), "num_local_experts": m.n_experts,
            "num_experts_per_tok": m.top_k, "router_aux_loss_coef": m.aux_loss_weight, "router_jitter_noise": 0.0,
            "output_router_logits": False, "sliding_window": None}


def from_hf_config(hf: dict, where: str) -> dict:
    if hf.get("sliding_window"):
        refuse(where, "sliding_window", hf["sliding_window"], "full attention (null)")
    settings = llama_hf.decoder_settings(hf, where)
    return dict(arch="llama", preset="mixtral-tiny", **settings, moe_every=1, n_experts=hf["num_local_experts"],
                top_k=hf["num_experts_per_tok"], n_shared_experts=0, expert_ffn_dim=hf["intermediate_size"],
                router_score="softmax", moe_norm_topk=True,
                aux_loss_weight=float(hf.get("router_aux_loss_coef", 0.001)),
                z_loss_weight=0.0, capacity_factor=0.0, aux_free_bias_rate=0.0)


HF = HFMapping(architecture="MixtralForCausalLM", model_types=("mixtral",), to_hf_config=to_hf_config,
               from_hf_config=from_hf_config, to_hf_names=to_hf_names, from_hf_names=from_hf_names)
