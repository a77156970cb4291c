"""QK-clip (MuonClip, Kimi K2) for ``train.optimizer=muon`` with ``train.muon_qk_clip`` = tau > 0.

Muon keeps the update's spectral norm fixed, so nothing stops the query and key weights from growing until the
attention logits explode (Kimi K2 saw logits above 1,000). MuonClip rescales, after each optimizer step, the
query and key projections of the heads whose largest pre-softmax logit in that step's forwards exceeded tau:

    gamma_h = min(1, tau / max_logit_h)
    W_q rows of query head h       *= sqrt(gamma_h)
    W_k rows of key head j         *= sqrt(min over the query heads h reading j of gamma_h)

With one key head per query head (multi-head attention) that is Kimi K2's rule: both sides sqrt(gamma_h), so the
head's logits scale by exactly gamma_h and its largest lands on tau. With grouped key heads (GQA) a key head is
shared: it takes the smallest gamma of its group (the largest logit over the query heads sharing it, as Kimi K2
does for the key part MLA shares), each query head its own sqrt(gamma_h); a head's logits then scale by
sqrt(gamma_h gamma_min) <= gamma_h, so every head ends at or below tau (heads of the group that did not exceed tau
shrink a little too: the price of never scaling a weight up). The projections' biases (qkv_bias) scale with their
rows, so that q and k scale exactly. The momentum is left alone (as Kimi K2).

The measurement (megaloom/models/attention.py, `head_logit_max`, only while this is installed): each training
forward computes q k^T * scale again in fp32 under no_grad, the queries in chunks to bound memory, masked as the
attention masks (causal, window, the dense document mask), before any soft-cap; the max per head is kept over the
step's micro-batches (and recomputed forwards: the max is idempotent). About a third of the attention forward's
FLOPs more, only with the flag. Compiled blocks trace it (the record is a module attribute set in the graph,
no graph break; Inductor on CPU gives the eager maxima within 2e-8).

Distribution: heads are tp-sharded (each tp rank owns its query heads' rows), so the tp ranks need each other only
where key heads are replicated over tp ranks (tp > model.n_kv_heads): then the query maxima of the ranks sharing a
key head are gathered over tp. The data-parallel replicas saw different data: the maxima are all-reduced (max)
over the dp group so that every replica applies the same scaling. Under ZeRO-1/2 the scaling is applied to the
optimizer's tensors (this rank's segments: the fp32 masters, or views into the fp32 parameters), before the
parameters are published to the replicas; without ZeRO to the (tp-local) parameters. Pipeline stages clip their
own layers.

Refused (ConfigError): context parallelism (the attention then runs on pieces of the sequence, its scores never
whole in one module), latent attention (MLA: its query and key come through shared low-rank projections and a
shared rope key; this code knows only q_proj / k_proj rows), QK-norm (a norm after the projections undoes any
scaling of W_q / W_k), frozen query or key weights (LoRA), models with no megaloom Attention (T5, ViT towers).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from megaloom.config import ConfigError
from megaloom.models.attention import Attention
from megaloom.parallel import comm
from megaloom.parallel.layout import layout_of
from megaloom.parallel.mesh import Mesh

# (tensor, start): this rank's optimizer tensor standing for elements [start, start + numel) of a flattened
# (tp-local) parameter; the parameter itself with start 0 when it is held whole.
Pieces = Callable[[nn.Parameter], list[tuple[torch.Tensor, int]]]


def _refuse(model: nn.Module, layers: list[Attention], mesh: Mesh) -> None:
    from megaloom.models.mla import MLAttention

    fix = "set train.muon_qk_clip=0 (plain Muon)"
    if mesh.cp > 1:
        raise ConfigError(f"train.muon_qk_clip with parallel.cp={mesh.cp}: the attention runs on pieces of the "
                          f"sequence and no module sees a head's whole scores; set parallel.cp=1 or {fix}.")
    if not layers:
        raise ConfigError(f"train.muon_qk_clip: {type(model).__name__} has no megaloom Attention module whose "
                          f"logits could be measured (encoder-decoder and vision towers are not served); {fix}.")
    for a in layers:
        if isinstance(a, MLAttention):
            raise ConfigError("train.muon_qk_clip with latent attention (MLA): its queries and keys come through "
                              "shared low-rank projections and a shared rope key, not q_proj / k_proj rows per "
                              f"head; {fix}.")
        if type(a).per_head_qk is not Attention.per_head_qk:
            raise ConfigError(f"train.muon_qk_clip with {type(a).__name__} (QK-norm): the norm after the "
                              "projections undoes any scaling of W_q / W_k (and already bounds the logits); "
                              f"{fix}.")
        if not (a.q_proj.weight.requires_grad and a.k_proj.weight.requires_grad):
            raise ConfigError(f"train.muon_qk_clip with frozen query / key weights (LoRA, model freezing): the "
                              f"clip rescales W_q and W_k, which the optimizer does not hold; {fix}.")


class QKClip:
    """Installed on a Muon optimizer's ``after_step``: reads the attention modules' logit maxima, agrees on them
    over dp (and tp where key heads are replicated), and scales the rows of the heads above ``tau``.
    ``last_max``: each layer's per-head maxima (tp-local query heads) of the last step; ``clipped``: how many
    (layer, head) pairs were scaled so far on this rank."""

    def __init__(self, model: nn.Module, tau: float, mesh: Mesh, pieces: Pieces) -> None:
        if not tau > 0:
            raise ConfigError(f"train.muon_qk_clip must be > 0 to clip (got {tau}); 0 turns it off.")
        self.layers = [m for m in model.modules() if isinstance(m, Attention)]
        _refuse(model, self.layers, mesh)
        self.tau, self.mesh, self.pieces = float(tau), mesh, pieces
        for a in self.layers:
            a.track_qk_logits = True
        self.heads = [a.q_proj.weight.shape[0] // a.head_dim for a in self.layers]
        self.replicas = [layout_of(a.k_proj.weight).tp_replicas if mesh.tp > 1 else 1 for a in self.layers]
        self.last_max: list[torch.Tensor] = []
        self.clipped = 0

    def _maxima(self) -> torch.Tensor:
        """The step's maxima of every layer's local query heads, concatenated, max over the dp group; cleared in
        the modules."""
        device = self.layers[0].q_proj.weight.device
        rows = []
        for a, h in zip(self.layers, self.heads, strict=True):
            m = a.qk_logit_max
            rows.append(torch.full((h,), float("-inf"), device=device) if m is None else m.to(device))
            a.qk_logit_max = None
        return comm.all_reduce(torch.cat(rows).float(), self.mesh.dp_group, "max", self.mesh.recorder)

    def _group_maxima(self, maxima: list[torch.Tensor]) -> list[torch.Tensor]:
        """Per layer: the query maxima of every rank sharing this rank's key heads (tp-local heads alone unless
        key heads are replicated over tp ranks), in head order."""
        if max(self.replicas) == 1:
            return maxima
        flat = torch.cat(maxima)
        out = torch.empty(self.mesh.tp * flat.numel(), device=flat.device)
        comm.all_gather_into(out, flat, self.mesh.tp_group, self.mesh.recorder)
        every = out.view(self.mesh.tp, -1).split(self.heads, dim=1)  # per layer [tp, heads]
        shared = []
        for rep, per_rank in zip(self.replicas, every, strict=True):
            first = self.mesh.tp_rank // rep * rep
            shared.append(per_rank[first:first + rep].reshape(-1))
        return shared

    @torch.no_grad()
    def __call__(self) -> None:
        flat = self._maxima()
        maxima = list(flat.split(self.heads))
        self.last_max = [m.clone() for m in maxima]
        groups = self._group_maxima(maxima)
        for a, m, g in zip(self.layers, maxima, groups, strict=True):
            gamma_q = (self.tau / m).clamp(max=1.0)  # -inf / never measured: tau / -inf = -0 -> guarded below
            gamma_q = torch.where(m > self.tau, gamma_q, torch.ones_like(gamma_q))
            kv_heads = a.k_proj.weight.shape[0] // a.head_dim
            gamma_g = torch.where(g > self.tau, (self.tau / g).clamp(max=1.0), torch.ones_like(g))
            gamma_k = gamma_g.view(kv_heads, -1).amin(dim=1)
            if bool((gamma_q < 1).any()) or bool((gamma_k < 1).any()):
                self.clipped += int((gamma_q < 1).sum())
                self._scale(a.q_proj, gamma_q.sqrt(), a.head_dim)
                self._scale(a.k_proj, gamma_k.sqrt(), a.head_dim)

    def _scale(self, proj: nn.Module, head_scale: torch.Tensor, head_dim: int) -> None:
        """Multiply head h's rows of ``proj``'s weight (and bias) by ``head_scale[h]``, in every piece of them
        this rank's optimizer holds."""
        for p in (proj.weight, proj.bias):
            if p is None:
                continue
            block = head_dim * math.prod(p.shape[1:])  # elements of one head's rows, contiguous
            for t, start in self.pieces(p):
                scale_head_rows(t.detach().view(-1), start, block, head_scale)


def scale_head_rows(flat: torch.Tensor, start: int, block: int, head_scale: torch.Tensor) -> None:
    """``flat`` holds elements [start, start + numel) of a parameter whose head h is elements
    [h block, (h + 1) block): scale each head's part by ``head_scale[h]`` (heads at 1 untouched)."""
    end = start + flat.numel()
    for h in range(start // block, min(len(head_scale), -(-end // block))):
        s = float(head_scale[h])
        if s != 1.0:
            lo, hi = max(h * block, start), min((h + 1) * block, end)
            flat[lo - start:hi - start].mul_(s)


def optimizer_pieces(optimizer) -> Pieces:
    """Where ``optimizer`` (Muon, or ShardedMuon under ZeRO-1/2) holds each parameter on this rank."""
    if hasattr(optimizer, "segments"):
        held: dict[int, list[tuple[torch.Tensor, int]]] = {}
        for t, s in zip(optimizer.tensors, optimizer.segments, strict=True):
            held.setdefault(id(optimizer.named_params[s.owner][1]), []).append((t, s.start))
        return lambda p: held.get(id(p), [])
    return lambda p: [(p, 0)]


def install_qk_clip(model: nn.Module, optimizer, tau: float, mesh: Mesh) -> QKClip:
    """MuonClip on ``optimizer`` (Muon or ShardedMuon): the attention modules of ``model`` measure their logits,
    and every optimizer step ends with the clip. Compiled blocks (train.compile) trace the measurement into their
    graph (no break: tests/optim/test_qk_clip.py compiles with fullgraph=True)."""
    muon = getattr(optimizer, "inner", optimizer)
    if not hasattr(muon, "after_step"):
        raise ConfigError("train.muon_qk_clip needs train.optimizer=muon (MuonClip is Muon's); set "
                          "train.muon_qk_clip=0.")
    clip = QKClip(model, tau, mesh, optimizer_pieces(optimizer))
    muon.after_step = clip
    return clip
