"""One pipeline rank's share of the model: its layers (all its chunks), plus the embedding on the first stage
and the final norm, head and loss on the last.

`StageModule` is cut from a full, initialised `Transformer` built with the same seed on every rank, after
tensor parallelism (`parallelize_tensor` works on the whole model; cutting keeps each rank's shards and their
split markers). Layers keep their original index in a ModuleDict, so every parameter keeps the name it has
in the single model (``layers.5.attn.q_proj.weight``): checkpoints and gradient comparisons need no mapping.

Tied embeddings across stages: with pp > 1 the first stage's ``tok_emb.weight`` and the last stage's
``head.weight`` are two Parameters, equal at the start. After backward their gradients are summed over a
two-rank "embedding group" (`sync_tied_grads`), so both hold the single model's gradient and the optimizer
keeps them equal. The head copy is marked ``_pp_tied_copy`` so that a norm counts it once.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from megaloom.models.transformer import Transformer
from megaloom.parallel import comm
from megaloom.parallel.mesh import Mesh
from megaloom.parallel.pipeline.partition import Partition

_SPLIT_MARKS = ("_tp_dim", "_tp_replicas", "_sequence_parallel")


class StageModule(nn.Module):
    def __init__(self, model: Transformer, partition: Partition, pp_rank: int) -> None:
        super().__init__()
        if partition.n_layers != len(model.layers):
            raise ValueError(f"the partition is for {partition.n_layers} layers, the model has {len(model.layers)}")
        cfg = model.cfg
        self.cfg = cfg
        self.partition = partition
        self.pp_rank = pp_rank
        self.stages = partition.stages_of_rank(pp_rank)  # chunk c runs virtual stage stages[c]
        self.last_stage = partition.n_stages - 1
        self.has_embedding = 0 in self.stages
        self.has_head = self.last_stage in self.stages
        tied = model.head.weight is model.tok_emb.weight
        # Registration order follows Transformer's, so named_parameters() lists names in the same order.
        if self.has_embedding:
            self.tok_emb = model.tok_emb
            if cfg.arch == "gpt2":
                self.pos_emb = model.pos_emb
        self.drop = model.drop
        self.layers = nn.ModuleDict({str(i): model.layers[i] for s in self.stages for i in partition.layers(s)})
        if self.has_head:
            self.norm = model.norm
            self.head = model.head
            if tied and not self.has_embedding:  # the embedding lives on another rank: keep an equal copy
                copy = nn.Parameter(model.head.weight.detach().clone())
                for mark in _SPLIT_MARKS:
                    if hasattr(model.head.weight, mark):
                        setattr(copy, mark, getattr(model.head.weight, mark))
                copy._pp_tied_copy = True
                self.head.weight = copy
        self.tied_across_stages = tied and partition.pp > 1 and (self.has_embedding or self.has_head)
        if cfg.arch == "llama":  # RoPE tables on every stage (not saved: rebuilt from the config)
            self.register_buffer("rope_cos", model.rope_cos, persistent=False)
            self.register_buffer("rope_sin", model.rope_sin, persistent=False)
        # The hooks tensor parallelism may have replaced, and full recomputation of the first N layers.
        self.loss_fn = model.loss_fn
        self.head_loss = getattr(model, "head_loss", None)  # fused head + loss (train.fused_loss)
        self.seq_scatter = model.seq_scatter
        self.seq_gather = model.seq_gather
        self.recompute_layers = model.recompute_layers

    def chunk_parameters(self, chunk: int) -> list[nn.Parameter]:
        """The parameters chunk ``chunk`` computes with (what its weight-gradient pass must fill)."""
        stage = self.stages[chunk]
        mods: list[nn.Module] = [self.layers[str(i)] for i in self.partition.layers(stage)]
        if stage == 0:
            mods += [self.tok_emb] + ([self.pos_emb] if hasattr(self, "pos_emb") else [])
        if stage == self.last_stage:
            mods += [self.norm, self.head]
        seen: set[int] = set()
        out = []
        for mod in mods:
            for p in mod.parameters():
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
        return out

    def forward(self, x: torch.Tensor, chunk: int = 0, labels: torch.Tensor | None = None,
                seq_len: int | None = None) -> torch.Tensor:
        """Chunk ``chunk``: tokens [B, T] on the first stage, else hidden states [B, T(/tp with sp), D].
        Returns hidden states, or on the last stage the loss (logits without labels). ``seq_len``: the full
        sequence length T, needed by stages after the first (for RoPE)."""
        stage = self.stages[chunk]
        if stage == 0:
            seq_len = x.shape[1]
            # Transformer's own code on this module's attributes: one definition of the embedding and RoPE.
            x = self.seq_scatter(Transformer.embed(self, x))
        elif seq_len is None:
            raise ValueError("StageModule.forward needs seq_len for a stage after the first")
        rope = Transformer.rope(self, seq_len)
        for j, i in enumerate(self.partition.layers(stage)):
            layer = self.layers[str(i)]
            if j < self.recompute_layers and torch.is_grad_enabled():  # the first N blocks of each stage
                x = checkpoint(layer, x, rope, use_reentrant=False)
            else:
                x = layer(x, rope)
        if stage != self.last_stage:
            return x
        x = self.seq_gather(self.norm(x))
        if labels is not None and self.head_loss is not None:
            return self.head_loss(self.head, x, labels)
        logits = self.head(x)
        return logits if labels is None else self.loss_fn(logits, labels)


def build_stage(model: Transformer, partition: Partition, mesh: Mesh) -> StageModule:
    """This rank's stage module. The full model's other layers are dropped with it."""
    if partition.pp != mesh.pp:
        raise ValueError(f"the partition is for pp={partition.pp}, the mesh has pp={mesh.pp}")
    return StageModule(model, partition, mesh.pp_rank)


def build_embedding_groups(mesh: Mesh) -> Any:
    """The process group {first stage, last stage} of this rank's pipeline, or None (middle stage, pp == 1).

    Collective over the world: every rank creates every pipeline's pair, in the order of the mesh layout
    (dist.new_group must be called by all ranks in the same order), whether or not it belongs to it.
    """
    if mesh.pp == 1:
        return None
    mine = None
    for ranks in Mesh.layout(mesh.world_size, mesh.sizes, mesh.order)["pp"]:
        pair = [ranks[0], ranks[-1]]
        group = dist.new_group(pair, use_local_synchronization=False)
        if mesh.rank in pair:
            mine = group
    return mine


def tied_parameter(stage: nn.Module) -> nn.Parameter | None:
    """The embedding (first stage) or head copy (last stage) whose gradient is summed across stages."""
    if not getattr(stage, "tied_across_stages", False):
        return None
    return stage.tok_emb.weight if stage.has_embedding else stage.head.weight


def sync_tied_grads(stage: nn.Module, group: Any, mesh: Mesh) -> None:
    """Sum the tied embedding's gradient over the first and last stage (after the last backward of a step)."""
    p = tied_parameter(stage)
    if p is None:
        return
    if group is None:
        raise ValueError("tied embeddings across pipeline stages need the group from build_embedding_groups()")
    if p.grad is None:  # this stage saw no micro-batch; it still takes part in the collective
        p.grad = torch.zeros_like(p)
    comm.all_reduce(p.grad, group, recorder=mesh.recorder)


def checkpoint_name(name: str, p: nn.Parameter) -> str:
    """The name a parameter's optimizer state is stored under. The last stage's copy of a tied embedding is
    ``tok_emb.weight`` in the single model (``named_parameters`` lists a tied weight once), so its state is
    saved and looked up under that name: checkpoints stay loadable across pp layouts."""
    return "tok_emb.weight" if getattr(p, "_pp_tied_copy", False) else name
