"""Mixture-of-Experts feed-forward layer (single process; expert parallelism plugs in at the dispatcher).

One MoE forward is four steps, each replaceable on its own:

    route     Router: scores (softmax / sigmoid), top-k, weights, aux losses       [T, D] -> weights, experts [T, k]
    dispatch  LocalDispatcher.dispatch: copy every kept (token, expert) pair into a buffer grouped by expert,
              applying the capacity limit (dropless when capacity_factor <= 0)
    compute   GroupedExperts: SwiGLU of every expert on its contiguous rows (torch._grouped_mm on sm90 bf16,
              otherwise a loop of torch.mm over the groups; with train.fp8_experts, rowwise fp8 grouped GEMMs set
              by precision/fp8_convert.py)
    combine   LocalDispatcher.combine: weight each row by its router weight and sum back per token

An expert-parallel dispatcher (megaloom.parallel.expert: all-to-all) only has to provide the same
`dispatch`/`combine` pair; tensor parallelism of the experts plugs in at `expert_in` / `expert_out` (identity
here). Shared experts (DeepSeek) are a dense SwiGLU MLP added for every token.

The router's auxiliary losses do not travel with the model's output: `attach_aux_loss` hangs them on the
layer's output so that backward adds their gradient where they were computed. That is what makes them work
in any pipeline stage (only the last stage has a loss); the training loss reported stays the language-model
loss, and the aux losses are reported on their own.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from megaloom.accelerator import CUDA, cuda_capability
from megaloom.models.layers import MLP

# Set False to force the torch.mm fallback everywhere (debugging, or kernels that misbehave).
USE_GROUPED_MM = True


def is_moe_block(cfg, index: int) -> bool:
    """Whether block ``index`` of a ModelConfig's model has an MoE layer: every ``moe_every``-th block, after the
    first ``first_dense_layers`` (DeepSeek-V3 keeps its first 3 blocks dense)."""
    return (bool(cfg.moe_every) and (index + 1) % cfg.moe_every == 0
            and index >= getattr(cfg, "first_dense_layers", 0))


# --------------------------------------------------------------------------------------------------- routing
@dataclass
class RouterOutput:
    weights: torch.Tensor  # [T, k] fp32 combine weights (after optional renormalisation)
    experts: torch.Tensor  # [T, k] int64 chosen experts, in descending order of biased score
    probs: torch.Tensor  # [T, E] fp32 scores (softmax probabilities or sigmoid affinities)
    logits: torch.Tensor  # [T, E] fp32 router logits


def expert_counts(experts: torch.Tensor, n_experts: int) -> torch.Tensor:
    """[E] int64 assignments per expert. Not `torch.bincount`: its output size depends on the data, so on CUDA it
    reads the largest index back to the host (a sync per call) and breaks the compiled graph; an integer
    scatter-add has a fixed shape, stays on the device and is exact in any order (qwen3-moe-2.6b on an H200:
    two syncs per MoE layer and step removed)."""
    flat = experts.reshape(-1)
    return torch.zeros(n_experts, dtype=torch.long, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))


def load_balancing_loss(probs: torch.Tensor, experts: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Switch / Mixtral auxiliary loss E * sum_e f_e * P_e.

    f_e: fraction of the T*k routing assignments that picked expert e (no gradient); P_e: mean over tokens of the
    router probability of e (scores normalised to sum 1 per token, so sigmoid scores work too). Equals 1 at
    perfect balance with uniform probabilities, whatever k is.
    """
    counts = expert_counts(experts, n_experts).to(probs.dtype)
    f = counts / experts.numel()
    p = (probs / probs.sum(-1, keepdim=True)).mean(0)
    return n_experts * (f * p).sum()


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    """Router z-loss (ST-MoE): mean over tokens of logsumexp(logits)^2, keeps router logits small."""
    return torch.logsumexp(logits.float(), dim=-1).square().mean()


class Router(nn.Module):
    """Linear d_model -> n_experts (no bias), softmax or sigmoid scores, top-k selection.

    `expert_bias` (a buffer) is DeepSeek-V3's aux-loss-free balancing bias: it is added to the scores for the
    top-k *selection* only; the combine weights are always taken from the unbiased scores.

    DeepSeek-V3's group-limited routing (``n_groups`` > 1, HF's noaux_tc): the experts form ``n_groups`` equal
    groups, each scored by the sum of its two highest biased scores; a token picks its top-k experts only inside
    its ``topk_groups`` best groups (which bounds how many nodes its tokens travel to under expert parallelism).
    ``routed_scaling``: the combine weights' multiplier after renormalisation (DeepSeek-V3: 2.5).
    ``normalize_weights`` (default true): the chosen experts' weights renormalised to sum 1 per token (HF's
    norm_topk_prob); false: the raw scores of the chosen experts.
    """

    def __init__(self, d_model: int, n_experts: int, top_k: int, score_fn: str = "softmax",
                 normalize_weights: bool | None = None, n_groups: int = 1, topk_groups: int = 1,
                 routed_scaling: float = 1.0):
        super().__init__()
        if score_fn not in ("softmax", "sigmoid"):
            raise ValueError(f"router score_fn must be softmax or sigmoid, got {score_fn!r}")
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"top_k={top_k} must be in [1, n_experts={n_experts}]")
        if n_experts % n_groups or not 1 <= topk_groups <= n_groups:
            raise ValueError(f"router: {n_groups} expert groups must divide n_experts={n_experts} and topk_groups="
                             f"{topk_groups} lie in [1, {n_groups}]")
        self.n_experts, self.top_k, self.score_fn = n_experts, top_k, score_fn
        self.n_groups, self.topk_groups, self.routed_scaling = n_groups, topk_groups, routed_scaling
        # The chosen weights renormalised to sum 1 (model.moe_norm_topk, HF's norm_topk_prob): Mixtral, DeepSeek-V3
        # and the released Qwen3-MoE do; Qwen3MoeConfig's default and DeepSeek-V2 do not.
        self.normalize_weights = True if normalize_weights is None else normalize_weights
        self.proj = nn.Linear(d_model, n_experts, bias=False)
        self.register_buffer("expert_bias", torch.zeros(n_experts))

    def forward(self, x: torch.Tensor) -> RouterOutput:
        logits = self.proj(x).float()
        probs = logits.softmax(-1) if self.score_fn == "softmax" else logits.sigmoid()
        select = probs.detach() + self.expert_bias.float()
        if self.n_groups > 1:
            select = self._limit_to_groups(select)
        experts = select.topk(self.top_k, dim=-1).indices
        weights = probs.gather(-1, experts)
        if self.normalize_weights:
            weights = weights / weights.sum(-1, keepdim=True).clamp_min(1e-20)
        if self.routed_scaling != 1.0:
            weights = weights * self.routed_scaling
        return RouterOutput(weights, experts, probs, logits)

    def _limit_to_groups(self, select: torch.Tensor) -> torch.Tensor:
        """``select`` [T, E] with the experts outside each token's ``topk_groups`` best groups at -inf."""
        grouped = select.view(select.shape[0], self.n_groups, -1)
        best = grouped.topk(2, dim=-1).values.sum(-1).topk(self.topk_groups, dim=-1).indices  # [T, topk_groups]
        keep = torch.zeros(grouped.shape[:2], dtype=torch.bool, device=select.device).scatter_(1, best, True)
        return grouped.masked_fill(~keep[..., None], float("-inf")).view_as(select)

    @torch.no_grad()
    def update_bias(self, load: torch.Tensor, rate: float) -> None:
        """Aux-loss-free balancing step: bias += rate * sign(mean_load - load) (underloaded experts rise).

        `load` [E] is the tokens per expert since the last update, summed over every data-parallel rank."""
        load = load.to(self.expert_bias.device, torch.float32)
        self.expert_bias.add_(rate * torch.sign(load.mean() - load))


# -------------------------------------------------------------------------------------------- dispatch / combine
@dataclass
class Dispatched:
    x: torch.Tensor  # [N, D] token copies, grouped by expert (expert 0's rows first)
    counts: torch.Tensor  # [E] int64 rows per expert in x
    slot: torch.Tensor  # [N] flat assignment index t * k + j of each row
    weights: torch.Tensor  # [N] router weight of each row
    n_tokens: int
    top_k: int
    dropped: torch.Tensor  # scalar: assignments dropped by the capacity limit
    route: object = None  # what a non-local dispatcher needs to send the rows back (expert parallelism)


def expert_capacity(capacity_factor: float, n_tokens: int, top_k: int, n_experts: int) -> int | None:
    """ceil(capacity_factor * T * k / E) rows per expert, or None (dropless) when capacity_factor <= 0."""
    if capacity_factor <= 0:
        return None
    return math.ceil(capacity_factor * n_tokens * top_k / n_experts)


class LocalDispatcher:
    """Dispatch and combine on one process: a permutation into expert-contiguous rows and its inverse.

    Drop order under a capacity limit is deterministic: assignments are ranked by token position, then by rank
    within the token's top-k (the flat index t * k + j), and each expert keeps its first `capacity` of them.
    """

    def dispatch(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, n_experts: int,
                 capacity: int | None) -> Dispatched:
        n_tokens, top_k = experts.shape
        flat = experts.reshape(-1)
        order = torch.sort(flat, stable=True).indices  # by expert, then by flat index (token, rank)
        counts = expert_counts(flat, n_experts)
        dropped = torch.zeros((), dtype=torch.long, device=x.device)
        if capacity is not None:
            starts = torch.cumsum(counts, 0) - counts
            pos_in_expert = torch.arange(flat.numel(), device=x.device) - starts[flat[order]]
            order = order[pos_in_expert < capacity]
            kept = counts.clamp(max=capacity)
            dropped = (counts - kept).sum()
            counts = kept
        # Gather through a [T*k, D] copy so each row is picked at most once: the backward is then a scatter without
        # collisions, which is deterministic (x[order // top_k] would accumulate duplicates in a racy order on CPU).
        rows = x.repeat_interleave(top_k, dim=0)[order]
        return Dispatched(rows, counts, order, weights.reshape(-1)[order], n_tokens, top_k, dropped)

    def combine(self, y: torch.Tensor, d: Dispatched) -> torch.Tensor:
        """[N, D] expert outputs -> [T, D]: sum_j w_tj * y_tj (fp32 accumulation); dropped pairs contribute 0."""
        rows = y.float() * d.weights.float()[:, None]
        out = rows.new_zeros(d.n_tokens * d.top_k, y.shape[-1]).index_copy(0, d.slot, rows)
        return out.view(d.n_tokens, d.top_k, -1).sum(1).to(y.dtype)


# ----------------------------------------------------------------------------------------------------- experts
def _grouped_mm_ok(x: torch.Tensor, *dims: int) -> bool:
    if not (USE_GROUPED_MM and hasattr(torch, "_grouped_mm") and x.device.type == CUDA):
        return False
    if cuda_capability(x.device)[0] != 9:
        return False
    bf16 = x.dtype == torch.bfloat16 or (torch.is_autocast_enabled(CUDA)
                                          and torch.get_autocast_dtype(CUDA) == torch.bfloat16)
    return bf16 and all(d % 8 == 0 for d in dims)  # 16-byte aligned rows


class GroupedExperts(nn.Module):
    """n_experts SwiGLU MLPs stored stacked: gate/up [E, D, F], down [E, F, D].

    ``fp8_mm``: None (bf16 / fp32 GEMMs), or set by `megaloom.precision.fp8_convert` (train.fp8_experts) to the
    grouped GEMM ``fp8_mm(x [T, K], w [E, K, N], offs) -> [T, N]`` that runs the three in fp8."""

    def __init__(self, n_experts: int, d_model: int, ffn_dim: int):
        super().__init__()
        self.w_gate = nn.Parameter(torch.empty(n_experts, d_model, ffn_dim))
        self.w_up = nn.Parameter(torch.empty(n_experts, d_model, ffn_dim))
        self.w_down = nn.Parameter(torch.empty(n_experts, ffn_dim, d_model))
        self.fp8_mm: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02, out_std: float | None = None) -> None:
        nn.init.normal_(self.w_gate, 0.0, std)
        nn.init.normal_(self.w_up, 0.0, std)
        nn.init.normal_(self.w_down, 0.0, std if out_std is None else out_std)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x [N, D] with expert e's rows contiguous, counts [E] -> [N, D]."""
        if self.fp8_mm is not None:
            return self._fp8(x, counts)
        if _grouped_mm_ok(x, *self.w_gate.shape[1:]):
            return self._grouped(x, counts)
        return self._looped(x, counts)

    def _grouped(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        xb = x.to(torch.bfloat16)
        gate = torch._grouped_mm(xb, self.w_gate.to(torch.bfloat16), offs=offs)
        up = torch._grouped_mm(xb, self.w_up.to(torch.bfloat16), offs=offs)
        return torch._grouped_mm(F.silu(gate) * up, self.w_down.to(torch.bfloat16), offs=offs)

    def _fp8(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        mm = self.fp8_mm
        return mm(F.silu(mm(x, self.w_gate, offs)) * mm(x, self.w_up, offs), self.w_down, offs)

    def extra_repr(self) -> str:
        return "fp8 grouped GEMMs" if self.fp8_mm is not None else ""

    def _looped(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        outs, start = [], 0
        for e, n in enumerate(counts.tolist()):  # one host sync; fine on CPU and as the GPU fallback
            if n == 0:
                continue
            xs = x[start:start + n]
            h = F.silu(torch.mm(xs, self.w_gate[e])) * torch.mm(xs, self.w_up[e])
            outs.append(torch.mm(h, self.w_down[e]))
            start += n
        if not outs:
            return x.new_zeros(0, self.w_down.shape[-1])
        return torch.cat(outs)


# ------------------------------------------------------------------------------------------------ aux losses
class _AttachAuxLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor, grad_scale: float) -> torch.Tensor:
        ctx.grad_scale, ctx.aux_meta = grad_scale, (aux.shape, aux.dtype)
        # A copy, not an alias of the input: torch 2.11's compiled autograd.Function can zero the gradient of
        # an output that aliases an input (seen with fp8's no-op casts, pytorch#180642).
        return out.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        shape, dtype = ctx.aux_meta
        return grad, torch.full(shape, ctx.grad_scale, dtype=dtype, device=grad.device), None


def attach_aux_loss(out: torch.Tensor, aux: torch.Tensor, grad_scale: float = 1.0) -> torch.Tensor:
    """`out` unchanged; its backward also back-propagates `aux` with d(total loss)/d(aux) = `grad_scale`.

    Equivalent to adding `grad_scale * aux` to the loss, wherever the loss lives (Megatron's
    MoEAuxLossAutoScaler). The trainer sets `grad_scale` = (fp16 loss scale) / (micro-batches per step),
    the factors its loss gets."""
    return _AttachAuxLoss.apply(out, aux, grad_scale)


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


# --------------------------------------------------------------------------------------------------------- MoE
class MoE(nn.Module):
    """Drop-in replacement of the MLP: forward(x [B, T, D]) -> [B, T, D].

    After each forward: `aux_loss` (scalar: aux_loss_weight * load balancing + z_loss_weight * z-loss; in
    training its gradient is already attached to the output, see `attach_aux_loss`), `last_load` [E] (tokens
    routed to each expert, before capacity drops) and
    `last_dropped_fraction` (scalar tensor). In training, `load_since_update` accumulates the load for
    `update_bias()` (aux-loss-free balancing), which the trainer calls after each optimizer step.
    """

    def __init__(self, d_model: int, n_experts: int, top_k: int, expert_ffn_dim: int, n_shared_experts: int = 0,
                 score_fn: str = "softmax", normalize_weights: bool | None = None, aux_loss_weight: float = 0.0,
                 z_loss_weight: float = 0.0, capacity_factor: float = 0.0, aux_free_bias_rate: float = 0.0,
                 dropout: float = 0.0, init_std: float = 0.02, out_std: float | None = None, n_groups: int = 1,
                 topk_groups: int = 1, routed_scaling: float = 1.0):
        super().__init__()
        self.n_experts, self.top_k = n_experts, top_k
        self.aux_loss_weight, self.z_loss_weight = aux_loss_weight, z_loss_weight
        self.capacity_factor, self.aux_free_bias_rate = capacity_factor, aux_free_bias_rate
        self.router = Router(d_model, n_experts, top_k, score_fn, normalize_weights, n_groups, topk_groups,
                             routed_scaling)
        self.experts = GroupedExperts(n_experts, d_model, expert_ffn_dim)
        self.shared = MLP(True, d_model, n_shared_experts * expert_ffn_dim, False, 0.0) if n_shared_experts else None
        self.dropout = nn.Dropout(dropout)
        self.dispatcher = LocalDispatcher()  # expert parallelism swaps this for an all-to-all dispatcher
        # Tensor parallelism of the experts swaps these for the region borders around the expert GEMMs.
        self.expert_in = _identity
        self.expert_out = _identity
        self.aux_grad_scale = 1.0  # d(loss)/d(aux_loss) for backward; set by the trainer (see attach_aux_loss)
        self.register_buffer("load_since_update", torch.zeros(n_experts), persistent=False)
        self.aux_loss = torch.zeros(())
        self.last_load = torch.zeros(n_experts)
        self.last_dropped_fraction = torch.zeros(())
        self.reset_parameters(init_std, out_std)

    @property
    def recompute_activation(self) -> bool:  # set by apply_recompute("selective"); applies to the shared MLP
        return self.shared is not None and self.shared.recompute_activation

    @recompute_activation.setter
    def recompute_activation(self, value: bool) -> None:
        if self.shared is not None:
            self.shared.recompute_activation = value

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02, out_std: float | None = None) -> None:
        out_std = std if out_std is None else out_std
        nn.init.normal_(self.router.proj.weight, 0.0, std)
        self.router.expert_bias.zero_()
        self.experts.reset_parameters(std, out_std)
        if self.shared is not None:
            for lin in (self.shared.gate_proj, self.shared.up_proj):
                nn.init.normal_(lin.weight, 0.0, std)
            nn.init.normal_(self.shared.down_proj.weight, 0.0, out_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        xf = x.reshape(-1, shape[-1])
        r = self.router(xf)
        capacity = expert_capacity(self.capacity_factor, xf.shape[0], self.top_k, self.n_experts)
        d = self.dispatcher.dispatch(xf, r.weights, r.experts, self.n_experts, capacity)
        y = self.dispatcher.combine(self.expert_out(self.experts(self.expert_in(d.x), d.counts)), d)
        if self.shared is not None:
            y = y + self.shared(xf)
        self._record(r)
        self.last_dropped_fraction = d.dropped.float() / r.experts.numel()
        out = self.dropout(y.to(x.dtype).view(shape))
        if self.aux_loss.requires_grad:
            out = attach_aux_loss(out, self.aux_loss, self.aux_grad_scale)
        return out

    def _record(self, r: RouterOutput) -> None:
        aux = r.logits.new_zeros(())
        if self.aux_loss_weight:
            aux = aux + self.aux_loss_weight * load_balancing_loss(r.probs, r.experts, self.n_experts)
        if self.z_loss_weight:
            aux = aux + self.z_loss_weight * z_loss(r.logits)
        self.aux_loss = aux
        load = expert_counts(r.experts, self.n_experts).float()
        self.last_load = load
        if self.training and torch.is_grad_enabled():
            self.load_since_update += load

    @torch.no_grad()
    def update_bias(self, load: torch.Tensor | None = None) -> None:
        """Aux-loss-free balancing after an optimizer step; `load` defaults to the load since the last call
        (all-reduce it over data parallel first when training on several ranks)."""
        if self.aux_free_bias_rate > 0:
            self.router.update_bias(self.load_since_update if load is None else load, self.aux_free_bias_rate)
        self.load_since_update.zero_()
