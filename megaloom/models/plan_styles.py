"""Parallel styles: the words a model family's parallel plan is written in.

A plan is data: a table from submodule names (``fnmatch`` patterns over ``named_modules``, e.g.
``"layers.*.attn.q_proj"``) to a style or a tuple of styles, read by `megaloom.parallel.tensor.parallelize_tensor`
the way TorchTitan's `parallelize_module` and picotron's tables are. Every style of a tuple that accepts the
module is applied, in order: ``(Experts(), Region())`` on ``layers.*.mlp`` splits an MoE layer by experts
(`Experts` accepts only MoE layers, `Region` all others) and a dense MLP by the region rule. A pattern that
matches no submodule is fine (a dense model has no experts). The styles say what is split;
`parallel/tensor.py` says how.

The plan is data, so it lives below both its writers and its reader: this module imports nothing of megaloom's,
the families write their plans with it and `megaloom.parallel.tensor` turns a plan into sharded layers; a model
never imports megaloom.parallel (which would load the mesh, the collectives and the runtime).
"""

from __future__ import annotations

from dataclasses import dataclass


class Style:
    """A way of splitting one submodule over the tensor-parallel (and expert-parallel) group."""

    owns_subtree = False  # True: the style splits the whole subtree; the plan does not descend into it


@dataclass(frozen=True)
class Colwise(Style):
    """nn.Linear split by output features (weight rows), inside a region. ``kv_heads``: a key / value
    projection, whose heads are replicated over groups of tp ranks when tp > n_kv_heads. ``replicated``: every
    tp rank holds all rows (latent attention's down-projections, read by every rank's heads): a column-parallel
    linear of tp replicas, whose gradients are partial sums over the ranks' heads. ``region_input=False``: the
    linear reads a tensor made inside the region (latent attention's up-projections read the latents), not the
    region's input, so it is not one of the linears that sequence parallelism feeds from the saved shard."""

    kv_heads: bool = False
    replicated: bool = False
    region_input: bool = True


@dataclass(frozen=True)
class Rowwise(Style):
    """nn.Linear split by input features; its output leaves the region (all-reduce, or reduce-scatter to
    sequence shards with sp). ``sequence=False``: always an all-reduce (a stream that sp never splits, such as an
    image encoder's patches)."""

    sequence: bool = True


@dataclass(frozen=True)
class Region(Style):
    """The module's first input enters the tp region once (identity forward + all-reduce backward, or the
    all-gather of sequence shards with sp), e.g. once for q, k and v together. ``sequence=False``: the input is
    never sequence-sharded (an image encoder's patches), so it enters as without sp."""

    sequence: bool = True


@dataclass(frozen=True)
class LocalHeads(Style):
    """An attention module whose core runs on this rank's heads: its attention-probability dropout draws
    from the tp-forked RNG stream so that each rank's heads get their own masks."""


@dataclass(frozen=True)
class VocabEmbedding(Style):
    """nn.Embedding split by vocabulary rows; partial lookups are summed (reduce-scattered over the sequence
    with sp, which also puts the residual stream into sequence shards)."""


@dataclass(frozen=True)
class SequencePositions(Style):
    """A lookup by index per token of the whole sequence (learned positions, BERT's segment ids): with sp each rank
    adds only its sequence shard's rows (its gradient is then a partial sum over tp). Left alone without sp."""


@dataclass(frozen=True)
class SequenceFirst(Style):
    """A module that reads the hidden state at position 0 through its ``first`` attribute (BERT's pooler): with sp
    only tp rank 0's shard holds it, so every rank gathers the first token of each shard and keeps rank 0's; the
    gradient goes back to rank 0's shard alone (each rank computes the same replicated loss from it)."""


@dataclass(frozen=True)
class VocabHead(Style):
    """The output head split by vocabulary rows; its input enters the region (all-gathered from sequence
    shards with sp), its logits stay split for the vocabulary-parallel loss."""


@dataclass(frozen=True)
class VocabLoss(Style):
    """The loss module: cross-entropy over vocabulary-split logits (full logits never exist)."""


@dataclass(frozen=True)
class SequenceParallel(Style):
    """A replicated module applied to the residual stream (norms): with sp it sees only this rank's tokens,
    so its parameters' gradients are partial sums over tp. Nothing to do without sp."""


@dataclass(frozen=True)
class PartialGrad(Style):
    """A replicated module applied to this rank's heads (e.g. QK-norm): its parameters' gradients are
    partial sums over tp, with or without sp."""


@dataclass(frozen=True)
class SequenceDropout(Style):
    """Dropout on the residual stream: with sp the ranks hold different tokens, so masks come from the
    tp-forked RNG stream; without sp the stream is replicated and the masks must agree (left alone)."""


@dataclass(frozen=True)
class SequenceScatter(Style):
    """A module that writes a full-sequence, replicated tensor (image features placed at <image> positions) into
    the residual stream: with sp it keeps this rank's sequence shard and all-gathers the gradient in backward,
    so what feeds it gets the whole gradient on every rank. Its ``split`` attribute is set; nothing without sp."""


@dataclass(frozen=True)
class Experts(Style):
    """A Mixture-of-Experts layer: experts split over ep, each expert's hidden units over tp, shared experts
    as a column/row pair (megaloom.parallel.expert). Accepts only MoE layers."""

    owns_subtree = True


Plan = dict[str, Style | tuple[Style, ...]]
