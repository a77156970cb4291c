"""How one parameter is laid out over the mesh: the single description every consumer queries.

Gradient synchronisation, the global gradient norm, ZeRO shards, checkpoints (gather and reshard) and the
pipeline's tied-embedding copy all need to know, for a parameter, which dimension is split over which group,
whether groups of ranks hold copies of one slice, and whether its gradient is a partial sum. That knowledge
lives in one frozen `Layout` attached to the parameter by the parallel layer (`set_layout`) and read with
`layout_of`; nothing else is stuck onto parameters.

Why not DTensor placements: the hot path of megaloom's tensor-parallel layers is plain tensors with explicit
collectives (Megatron-Core's design), which is what the H200 measurements were made with; a DTensor would add
dispatch on every op, and its placements cannot say "groups of tp/kv ranks share one KV head" (replicated KV
heads when tp > n_kv_heads). A `Layout` costs nothing at step time and converts to DTensor placements where a
library needs them (FSDP2 already wraps the local shards as DTensors over the dp group).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

_ATTR = "_megaloom_layout"


@dataclass(frozen=True)
class Layout:
    """``tp_dim``: the dimension split over the tp group (None: every tp rank holds the whole tensor).
    ``tp_replicas``: > 1 when groups of that many consecutive tp ranks hold the same slice (replicated KV heads).
    ``tp_partial``: replicated over tp, but each rank's gradient is a partial sum to be all-reduced over tp
    (weights applied to this rank's sequence shard under sp, or to this rank's heads, e.g. QK-norm).
    ``ep_dim``: the dimension split over the ep group (stacked MoE experts), None if not expert-parallel.
    ``tied_copy``: the last pipeline stage's copy of an embedding tied to the head (counted once in norms,
    stored under ``tok_emb.weight``)."""

    tp_dim: int | None = None
    tp_replicas: int = 1
    tp_partial: bool = False
    ep_dim: int | None = None
    tied_copy: bool = False

    @property
    def expert(self) -> bool:
        return self.ep_dim is not None

    def norm_weight(self, tp: int) -> float:
        """How much of this rank's squares count towards a sum over the full model: a tp-split tensor fully,
        one replicated on all tp ranks 1/tp, a replicated KV head 1/replicas."""
        return 1.0 / tp if self.tp_dim is None else 1.0 / self.tp_replicas

    def shard(self, full: torch.Tensor, tp_rank: int, tp: int, ep_rank: int = 0, ep: int = 1) -> torch.Tensor:
        """This rank's slice of ``full`` (a tensor of the parameter's full shape): experts first, then tp."""
        if self.ep_dim is not None and ep > 1:
            full = full.chunk(ep, self.ep_dim)[ep_rank]
        if self.tp_dim is None or tp == 1:
            return full
        return full.chunk(tp // self.tp_replicas, self.tp_dim)[tp_rank // self.tp_replicas]


    def box(self, local_shape: Sequence[int], tp_rank: int, tp: int, ep_rank: int = 0,
            ep: int = 1) -> tuple[list[int], list[int]]:
        """(full shape, start offsets) of this rank's slice of shape ``local_shape``: the inverse of `shard`."""
        full, starts = list(local_shape), [0] * len(local_shape)
        if self.ep_dim is not None and ep > 1:
            full[self.ep_dim] *= ep
            starts[self.ep_dim] = ep_rank * local_shape[self.ep_dim]
        if self.tp_dim is not None and tp > 1:
            slices = tp // self.tp_replicas
            full[self.tp_dim] *= slices
            starts[self.tp_dim] = (tp_rank // self.tp_replicas) * local_shape[self.tp_dim]
        return full, starts


REPLICATED = Layout()


def layout_of(p: object) -> Layout:
    """The layout of a parameter (or of anything standing in for one, e.g. a gradient view)."""
    return getattr(p, _ATTR, REPLICATED)


def set_layout(p: torch.Tensor, layout: Layout | None = None, **changes) -> torch.Tensor:
    """Attach ``layout`` (or the current layout with ``changes``) to ``p``; returns ``p``."""
    setattr(p, _ATTR, replace(layout if layout is not None else layout_of(p), **changes))
    return p


def single_model_name(name: str, p: object) -> str:
    """The name under which ``p``'s values live in the single model: the last pipeline stage's copy of a tied
    embedding holds ``tok_emb.weight`` (``named_parameters`` lists a tied weight once, under that name)."""
    return "tok_emb.weight" if layout_of(p).tied_copy else name


def copy_layout(src: object, dst: object) -> None:
    """Give ``dst`` (a new Parameter standing for ``src``: an FSDP2 shard, a pipeline copy) ``src``'s layout."""
    if hasattr(src, _ATTR):
        setattr(dst, _ATTR, getattr(src, _ATTR))
