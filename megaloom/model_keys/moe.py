"""The Mixture-of-Experts keys (megaloom/models/moe.py): which blocks hold experts, their routing and balancing."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from megaloom.model_keys.base import _f, divisors, require

if TYPE_CHECKING:
    from megaloom.model_keys import ModelConfig


@dataclass
class MoeKeys:
    moe_every: int = _f(0, "Mixture-of-Experts instead of the MLP in blocks i with (i+1) % moe_every == 0 "
                           "(1 = every block); 0 = dense model.", shape=True)
    n_experts: int = _f(8, "Routed experts per MoE layer.", shape="experts")
    top_k: int = _f(2, "Routed experts per token.")
    n_shared_experts: int = _f(0, "Shared experts (DeepSeek): a dense SwiGLU of n_shared_experts*expert_ffn_dim "
                                  "that every token uses.", shape="experts")
    expert_ffn_dim: int = _f(0, "Hidden size of one expert (SwiGLU); 0 = the dense MLP size.", shape="experts")
    router_score: str = _f("softmax", "Router scores: softmax (Mixtral) or sigmoid (DeepSeek-V3).",
                           ("softmax", "sigmoid"))
    moe_norm_topk: bool = _f(True, "Renormalise the chosen experts' router weights to sum 1 per token (HF's "
                                   "norm_topk_prob; Mixtral, DeepSeek-V3 and the released Qwen3-MoE: true). false: "
                                   "each expert's output is weighted by its raw score (softmax probability or "
                                   "sigmoid), times model.routed_scaling_factor (Qwen3MoeConfig's default).")
    aux_loss_weight: float = _f(0.01, "Weight of the load-balancing loss E*sum(f_e*P_e) (1 at perfect balance).")
    z_loss_weight: float = _f(0.0, "Weight of the router z-loss mean(logsumexp(logits)^2); 0 = off.")
    capacity_factor: float = _f(0.0, "Expert capacity ceil(cf*tokens*top_k/n_experts); overflow tokens are dropped "
                                     "(they keep only the residual); 0 = dropless.")
    aux_free_bias_rate: float = _f(0.0, "DeepSeek-V3 aux-loss-free balancing: per-expert selection-bias step after "
                                        "each optimizer step; 0 = off.")
    first_dense_layers: int = _f(0, "With model.moe_every: the first N blocks keep the dense MLP (model.ffn_dim) "
                                     "(DeepSeek-V3: 3; HF's first_k_dense_replace).", shape=True)
    n_expert_groups: int = _f(1, "Group-limited routing (DeepSeek-V3: 8 groups): the experts split into this many "
                                 "groups, each group scored by the sum of its two best (biased) scores; tokens choose "
                                 "their top_k experts inside the model.topk_groups best groups. 1 = no limit.")
    topk_groups: int = _f(1, "With model.n_expert_groups > 1: groups each token may route to (DeepSeek-V3: 4).")
    routed_scaling_factor: float = _f(1.0, "Multiplier of the routed experts' combine weights (after their "
                                           "renormalisation, if model.moe_norm_topk; DeepSeek-V3: 2.5).")


def check(m: ModelConfig, ep: int) -> None:
    """With experts (model.moe_every): the routing fits the experts, parallel.ep splits them whole, and
    group-limited routing's groups split the experts with at least top_k in the chosen groups."""
    if not m.moe_every:
        return
    require(1 <= m.top_k <= m.n_experts, f"model.top_k ({m.top_k}) must be between 1 and model.n_experts "
                                         f"({m.n_experts}).")
    require(m.n_experts % ep == 0,
            f"parallel.ep={ep} does not divide model.n_experts={m.n_experts} (each ep rank owns whole "
            f"experts); parallel.ep values that would work: {divisors(m.n_experts)}.")
    g = m.n_expert_groups
    require(g >= 1 and m.n_experts % g == 0,
            f"model.n_expert_groups ({g}) must divide model.n_experts ({m.n_experts}); values that would work: "
            f"{divisors(m.n_experts)}.")
    require(1 <= m.topk_groups <= g, f"model.topk_groups ({m.topk_groups}) must be between 1 and "
                                     f"model.n_expert_groups ({g}).")
    require(g == 1 or m.n_experts // g >= 2,
            f"model.n_expert_groups={g}: each group is scored by its two best experts, so it needs at least two "
            f"(model.n_experts={m.n_experts}).")
    require(m.topk_groups * (m.n_experts // g) >= m.top_k,
            f"model.top_k ({m.top_k}) exceeds the experts of model.topk_groups={m.topk_groups} groups "
            f"({m.topk_groups * (m.n_experts // g)}); raise model.topk_groups.")
    require(m.first_dense_layers >= 0, f"model.first_dense_layers must be >= 0, got {m.first_dense_layers}.")
    require(m.routed_scaling_factor > 0, f"model.routed_scaling_factor must be > 0, got {m.routed_scaling_factor}.")
