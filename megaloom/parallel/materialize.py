"""Allocate and initialise only this rank's shards of a model built on the meta device.

`megaloom train` builds the model on the meta device (no storage), applies the parallel plan and the pipeline
cut there, and then calls `materialize`: each parameter gets storage for its local slice only and is filled
with the values the single process would hold in that slice (`models/init.py`'s tiled, layout-independent
init, located by the parameter's `Layout`). No rank ever holds the whole model: its peak during construction is
its shards plus one tile. (ZeRO-3 still shards over dp after this: FSDP2 wraps the materialised tp-local
parameters, so a rank briefly holds its whole tp shard; see training/trainer.py.)
"""

from __future__ import annotations

import torch
from torch import nn

from megaloom.models.init import fill_slice
from megaloom.parallel.layout import layout_of, set_layout
from megaloom.parallel.mesh import Mesh


def _single_name(name: str, p: nn.Parameter) -> str:
    """The name whose values a parameter holds in the single model (the last stage's copy of a tied embedding
    holds the embedding's)."""
    return "tok_emb.weight" if layout_of(p).tied_copy else name


@torch.no_grad()
def materialize(model: nn.Module, device: torch.device, mesh: Mesh) -> nn.Module:
    """Give ``model`` (built on meta, tensor-parallel and pipeline-pruned as it will train) storage on
    ``device`` for this rank's slices and initialise them; returns it."""
    # to_empty makes new Parameters: carry the layouts over by name
    layouts = {name: layout_of(p) for name, p in model.named_parameters(remove_duplicate=False)}
    model.to_empty(device=device)
    model.tie_weights()  # to_empty unties a head that shares the embedding's Parameter
    for name, p in model.named_parameters():
        set_layout(p, layouts[name])
        full, starts = layouts[name].box(list(p.shape), mesh.tp_rank, mesh.tp, mesh.ep_rank, mesh.ep)
        single = _single_name(name, p)
        fill_slice(p.data, full, starts, model.init_rule(single), model.init_seed, single)
    model.reset_buffers()
    return model

