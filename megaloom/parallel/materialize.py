"""Allocate and initialise only this rank's shards of a model built on the meta device.

`megaloom train` builds the model on the meta device (no storage), applies the parallel plan and the pipeline
cut there, and then calls `materialize`: each parameter gets storage for its local slice only and is filled
with the values the single process would hold in that slice (`models/init.py`'s tiled, layout-independent
init, located by the parameter's `Layout`). No rank ever holds the whole model: its peak during construction is
its shards plus one tile, and its work its shards plus the tiles at their edges (a row-parallel weight's slice of
columns draws only its column blocks). With ZeRO-3, FSDP2 wraps the model while it is still on meta, so each rank
allocates only its dim-0 share of every (tensor-parallel) parameter.
"""

from __future__ import annotations

import torch
from torch import nn

from megaloom.models.init import fill_slice
from megaloom.parallel.layout import layout_of, set_layout, single_model_name
from megaloom.parallel.mesh import Mesh


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
        local, extra = _local_and_offset(p)
        full, starts = layouts[name].box(list(p.shape), mesh.tp_rank, mesh.tp, mesh.ep_rank, mesh.ep)
        single = single_model_name(name, p)
        fill_slice(local, full, [s + e for s, e in zip(starts, extra, strict=True)], model.init_rule(single),
                   model.init_seed, single)
    model.reset_buffers()
    return model


def _local_and_offset(p: nn.Parameter) -> tuple[torch.Tensor, list[int]]:
    """The storage to fill and its offset inside the tp-local tensor: an FSDP2 (ZeRO-3) parameter is a DTensor
    whose local part is a dim-0 slice of it; a plain parameter is all of it."""
    if hasattr(p, "to_local"):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        _, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        return p.to_local(), list(offset)
    return p.data, [0] * p.dim()
