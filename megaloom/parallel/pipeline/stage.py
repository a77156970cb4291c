"""One pipeline rank's share of the model: the model itself, pruned to its stages' parts, and the span of
layers each of its chunks runs.

`build_stage` takes a full, initialised `Transformer` (after tensor parallelism) and removes what other stages
own: blocks outside this rank's stages, the embedding unless it holds the first stage, the final norm, head
and loss unless it holds the last. Layers are keyed by their global index, so every parameter keeps the name
it has in the single model (``layers.5.attn.q_proj.weight``): checkpoints and gradient comparisons need no
mapping. Each chunk runs the model's own forward over its `Span`: there is one forward, not a second copy.

Tied embeddings across stages: with pp > 1 the first stage's ``tok_emb.weight`` and the last stage's
``head.weight`` are two Parameters, equal at the start. After backward their gradients are summed over a
two-rank "embedding group" (`sync_tied_grads`), so both hold the single model's gradient and the optimizer
keeps them equal. The head copy's layout says ``tied_copy`` so that a norm counts it once.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from megaloom.models.transformer import Span, Transformer
from megaloom.parallel import comm
from megaloom.parallel.groups import partition_group
from megaloom.parallel.layout import copy_layout, layout_of, set_layout, single_model_name
from megaloom.parallel.mesh import Mesh
from megaloom.parallel.pipeline.partition import Partition
from megaloom.parallel.tp_layers import ColumnParallelLinear, VocabParallelEmbedding, lookup_vocab_rows


def prune_to_stages(model: Transformer, partition: Partition, pp_rank: int) -> Transformer:
    """Remove from ``model`` (in place) every part that pipeline rank ``pp_rank`` does not run; returns it."""
    if partition.n_layers != len(model.layers):
        raise ValueError(f"the partition is for {partition.n_layers} layers, the model has {len(model.layers)}")
    stages = partition.stages_of_rank(pp_rank)
    keep = {i for s in stages for i in partition.layers(s)}
    tied = model.tie_embeddings_active()
    has_embedding, has_head = 0 in stages, partition.n_stages - 1 in stages
    model.layers = nn.ModuleDict({k: b for k, b in model.layers.items() if int(k) in keep})
    if has_head and not has_embedding and not tied and getattr(model, "mtp", None) is not None:
        # Multi-token prediction looks the tokens ahead up in the (untied) input embedding, which lives on the first
        # stage: this stage keeps an equal copy, summed with it over the embedding group like a tied one.
        model.mtp_lookup = embedding_copy(model.tok_emb)
    if not has_embedding:
        for name in model.embedding_parts():
            setattr(model, name, None)
    if not has_head:
        model.norm = model.head = model.loss = None
        if getattr(model, "mtp", None) is not None:  # multi-token prediction goes with the head
            model.mtp = None
    elif tied and not has_embedding:  # the embedding lives on another rank: keep an equal copy
        copy = nn.Parameter(model.head.weight.detach().clone(), requires_grad=model.head.weight.requires_grad)
        copy_layout(model.head.weight, copy)
        model.head.weight = set_layout(copy, tied_copy=True)
        if getattr(model, "mtp", None) is not None:  # its tokens ahead are looked up in that copy
            model.mtp_lookup = TiedRowsLookup(model.head)
    return model


def embedding_copy(emb: nn.Module) -> nn.Module:
    """A copy of the token embedding module ``emb`` (plain or vocabulary-parallel) over a new Parameter of equal
    values, laid out as a ``tied_copy``: it checkpoints as ``tok_emb.weight`` and a norm counts it once."""
    w = emb.weight
    copy = nn.Parameter(w.detach().clone(), requires_grad=w.requires_grad)
    copy_layout(w, copy)
    if isinstance(emb, VocabParallelEmbedding):
        out = VocabParallelEmbedding(copy, emb.mesh, emb.output_mode)
    else:
        out = nn.Embedding(*w.shape, device="meta")  # its own weight is replaced at once
        out.weight = copy
    set_layout(copy, layout_of(w), tied_copy=True)
    return out


class TiedRowsLookup:
    """Token embeddings from a last stage's head, the tied copy of the embedding (multi-token prediction, which
    runs there, looks up the tokens ahead): its gradient joins the copy's, which the embedding group sums with the
    first stage's. Under tp the head holds vocabulary rows, looked up as the vocabulary-parallel embedding does
    (sequence shards with sp, as the head's input is). A callable, not a module: no second name for the weight."""

    def __init__(self, head: nn.Module) -> None:
        self.head = head

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        head, w = self.head, self.head.weight
        if isinstance(head, ColumnParallelLinear):
            mode = "reduce_scatter" if head.input_mode == "gather" else "reduce"
            return lookup_vocab_rows(ids, w, head.mesh.tp_rank * w.shape[0], head.mesh, mode)
        return F.embedding(ids, w)


class PipelineStage:
    """This rank's pruned model plus what the schedule executor needs: the span each chunk runs (chunk c runs
    virtual stage ``stages[c]``), whether it holds the embedding / head, and the parameters per chunk."""

    def __init__(self, model: Transformer, partition: Partition, pp_rank: int) -> None:
        tied = model.tie_embeddings_active()
        mtp_untied = not tied and getattr(model, "mtp", None) is not None  # the last stage keeps an embedding copy
        self.model = prune_to_stages(model, partition, pp_rank)
        self.cfg, self.partition, self.pp_rank = model.cfg, partition, pp_rank
        self.stages = partition.stages_of_rank(pp_rank)
        self.last_stage = partition.n_stages - 1
        self.has_embedding = 0 in self.stages
        self.has_head = self.last_stage in self.stages
        self.spans = [Span(tuple(partition.layers(s)), s == 0, s == self.last_stage) for s in self.stages]
        # The embedding's copy on the last stage: the head (tied), or multi-token prediction's lookup (untied)
        self.tied_across_stages = (tied or mtp_untied) and partition.pp > 1 and (self.has_embedding or self.has_head)

    def __call__(self, x: torch.Tensor, chunk: int = 0, labels: torch.Tensor | None = None,
                 seq_len: int | None = None, **kwargs) -> torch.Tensor:
        """Chunk ``chunk``: tokens [B, T] on the first stage, else hidden states [B, T(/tp with sp), D] and
        ``seq_len`` the full sequence length. Hidden states out, or on the last stage the loss (logits
        without labels). ``kwargs``: the first stage's extra model inputs (a multimodal model's images)."""
        return self.model(x, labels, span=self.spans[chunk], seq_len=seq_len, **kwargs)

    def parameters(self):
        return self.model.parameters()

    def chunk_parameters(self, chunk: int) -> list[nn.Parameter]:
        """The parameters chunk ``chunk`` computes with (what its weight-gradient pass must fill)."""
        span, m = self.spans[chunk], self.model
        mods: list[nn.Module] = [m.layers[str(i)] for i in span.layers]
        if span.embed:
            mods += [getattr(m, name) for name in m.embedding_parts()]
        if span.head:
            mods += [m.norm, m.head] + ([m.mtp] if getattr(m, "mtp", None) is not None else [])
        seen: set[int] = set()
        out = []
        for mod in mods:
            for p in mod.parameters():
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
        return out


def build_stage(model: Transformer, partition: Partition, mesh: Mesh) -> PipelineStage:
    """This rank's stage; ``model`` is pruned in place (the other stages' layers are dropped)."""
    if partition.pp != mesh.pp:
        raise ValueError(f"the partition is for pp={partition.pp}, the mesh has pp={mesh.pp}")
    return PipelineStage(model, partition, mesh.pp_rank)


def build_embedding_groups(mesh: Mesh) -> Any:
    """The process group {first stage, last stage} of this rank's pipeline, or None (middle stage, pp == 1).

    Collective over the world: one creation call on every rank (`groups.partition_group`), whose partition is
    the pairs plus every middle-stage rank alone, so that it covers the world.
    """
    if mesh.pp == 1:
        return None
    pipelines = Mesh.layout(mesh.world_size, mesh.sizes, mesh.order)["pp"]
    parts = [[r[0], r[-1]] for r in pipelines] + [[x] for r in pipelines for x in r[1:-1]]
    group = partition_group(sorted(parts), mesh.rank, "pp:embedding", timeout=mesh.group_timeout)
    mesh.extra_groups.append(group)  # its timeout follows the mesh's after step 1 (runtime.shorten_timeouts)
    return None if 0 < mesh.pp_rank < mesh.pp - 1 else group


def tied_parameter(stage: PipelineStage) -> nn.Parameter | None:
    """The embedding (first stage) or head copy (last stage) whose gradient is summed across stages."""
    if not stage.tied_across_stages:
        return None
    m = stage.model
    if stage.has_embedding:
        return m.tok_emb.weight
    lookup = getattr(m, "mtp_lookup", None)
    return lookup.weight if isinstance(lookup, nn.Module) else m.head.weight


def sync_tied_grads(stage: PipelineStage, group: Any, mesh: Mesh) -> None:
    """Sum the tied embedding's gradient over the first and last stage (after the last backward of a step)."""
    p = tied_parameter(stage)
    if p is None or not p.requires_grad:  # frozen (model.freeze, LoRA's base) on both stages: nothing to sum
        return
    if group is None:
        raise ValueError("tied embeddings across pipeline stages need the group from build_embedding_groups()")
    if p.grad is None:  # this stage saw no micro-batch; it still takes part in the collective
        p.grad = torch.zeros_like(p)
    comm.all_reduce(p.grad, group, recorder=mesh.recorder)


checkpoint_name = single_model_name  # the name a parameter's optimizer state is stored under
