"""Checkpoint state as each rank holds it: slices of the single model's tensors, written and read in place.

Every tensor of a checkpoint is stored under its single-model name (``model.layers.3.attn.q_proj.weight``,
``optim.state.<name>.exp_avg``) with its full shape, as chunks at global offsets. A rank contributes the boxes it
holds and nothing else: a tensor-parallel shard (its `Layout` gives the box), an expert-parallel rank's experts,
a pipeline stage's layers, a ZeRO rank's flat segment of the optimizer state (a flat range of a row-major tensor
is a few boxes: a partial row, whole rows, a partial row), an FSDP2 (ZeRO-3) parameter's dim-0 shard (one box, at
the offset its DTensor placement gives, with or without an optimizer). Copies
held by several ranks (data-parallel replicas, replicated KV heads) are the same box: DCP's planner writes each
once, and checks that the boxes of all ranks tile every tensor exactly. Loading asks for this rank's boxes of
the new layout and DCP reads the overlapping parts of whatever chunks were saved, so a checkpoint written at
any layout (or an older one of full tensors) loads at any other, and no rank ever holds a tensor it does not own.

The protocol is DCP's own extension point for tensors sharded their own way (``__create_write_items__``,
``__create_chunk_list__``, ``__get_tensor_shard__``, the one DTensor implements): `Slices` implements it for a
tensor of megaloom's layouts, and the two planners below (DCP's defaults with their documented lookup hook
extended) find a `Slices`' chunk by offset.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from megaloom.checkpoint.safe_metadata import SafeLoadPlanner
from megaloom.parallel.layout import layout_of, single_model_name
from megaloom.parallel.mesh import Mesh


@dataclass
class Slices:
    """One tensor of the checkpoint as this rank holds it: ``pieces`` are (global offsets, local tensor) boxes of
    a tensor of ``shape``. The local tensors are views of the live state: loading writes straight into them."""

    shape: torch.Size
    pieces: list[tuple[torch.Size, torch.Tensor]]

    def size(self) -> torch.Size:
        return self.shape

    def __create_write_items__(self, fqn: str, obj: object) -> list[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn, off), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=off, sizes=t.size()),
                                                      properties=TensorProperties.create_from_tensor(t),
                                                      size=self.shape))
                for off, t in self.pieces]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=off, sizes=t.size()) for off, t in self.pieces]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for off, t in self.pieces:
            if off == index.offset:
                return t
        raise ValueError(f"{index.fqn}: this rank holds no chunk at {tuple(index.offset or ())}")

    def map(self, fn) -> Slices:
        """The same boxes with each local tensor replaced by ``fn(tensor)`` (e.g. a host copy)."""
        return Slices(self.shape, [(off, fn(t)) for off, t in self.pieces])


class SlicesSavePlanner(DefaultSavePlanner):
    """DCP's default save planner that also finds the chunks of `Slices`."""

    def lookup_object(self, index: MetadataIndex):
        obj = self.state_dict.get(index.fqn)
        return obj.__get_tensor_shard__(index) if isinstance(obj, Slices) else super().lookup_object(index)


class SlicesLoadPlanner(SafeLoadPlanner):
    """DCP's default load planner (non-tensor values read without arbitrary unpickling) that reads into the
    chunks of `Slices`. Its set-up walks the state dict
    with a function that knows only tensor types, so `Slices` sit out that walk behind placeholders."""

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        hidden: list[tuple[dict, str, str, Slices]] = []

        def hide(tree: dict, prefix: str) -> None:
            for key, value in tree.items():
                if isinstance(value, dict):
                    hide(value, f"{prefix}{key}.")
                elif isinstance(value, Slices):
                    hidden.append((tree, key, f"{prefix}{key}", value))
                    tree[key] = torch.empty(0)

        hide(state_dict, "")
        super().set_up_planner(state_dict, metadata, is_coordinator)
        for tree, key, flat, value in hidden:
            tree[key] = value
            if flat in self.state_dict:
                self.state_dict[flat] = value

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        obj = self.state_dict.get(index.fqn)
        return obj.__get_tensor_shard__(index) if isinstance(obj, Slices) else super().lookup_tensor(index)


def flat_range_boxes(shape: Sequence[int], start: int, length: int) -> Iterator[tuple[list[int], list[int], int]]:
    """The boxes (offsets, sizes, flat start) that elements [start, start + length) of a row-major tensor of
    ``shape`` consist of, in order; each is a contiguous run of that range."""
    end = start + length
    if length <= 0:
        return
    if len(shape) <= 1:
        yield [start], [length], start
        return
    row = math.prod(shape[1:])
    first_full, last_full = -(-start // row), end // row
    if first_full > last_full:  # inside one row
        r = start // row
        for off, size, flat in flat_range_boxes(shape[1:], start - r * row, length):
            yield [r] + off, [1] + size, r * row + flat
        return
    if start < first_full * row:  # the tail of a partial first row
        r = start // row
        for off, size, flat in flat_range_boxes(shape[1:], start - r * row, first_full * row - start):
            yield [r] + off, [1] + size, r * row + flat
    if last_full > first_full:  # whole rows
        yield [first_full] + [0] * (len(shape) - 1), [last_full - first_full] + list(shape[1:]), first_full * row
    if end > last_full * row:  # the head of a partial last row
        for off, size, flat in flat_range_boxes(shape[1:], 0, end - last_full * row):
            yield [last_full] + off, [1] + size, last_full * row + flat


def _alias(t: torch.Tensor) -> torch.Tensor:
    """``t``, or when it is a contiguous view into a larger host storage (a ZeRO segment of a bucket, one box of a
    segment), a tensor over exactly its bytes of the same memory. DCP's writer copies a tensor whose storage is
    larger than the tensor (so that torch.save writes only its part) and holds the copies until the whole file is
    written: for a ZeRO rank that was a second copy of everything it saves."""
    if type(t) is not torch.Tensor or t.device.type != "cpu" or not t.is_contiguous() \
            or t.untyped_storage().nbytes() == t.nbytes:
        return t
    start = t.storage_offset() * t.element_size()
    storage = t.untyped_storage()[start:start + t.nbytes]  # shares the memory (and keeps the whole alive)
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(storage, 0, t.shape, t.stride())


def _flat_pieces(local: torch.Tensor, local_shape: Sequence[int], start: int, base: Sequence[int]):
    """Pieces of a flat segment ``local`` (elements [start, start + numel) of a tensor of ``local_shape`` whose
    global offsets are ``base``)."""
    flat = local.reshape(-1)
    out = []
    for off, size, f in flat_range_boxes(local_shape, start, flat.numel()):
        view = _alias(flat[f - start:f - start + math.prod(size)].view(size))
        out.append((torch.Size([b + o for b, o in zip(base, off, strict=True)]), view))
    return out


def _own_part(t: torch.Tensor) -> tuple[list[int], torch.Tensor]:
    """The part of a (tp-local) tensor this rank holds: (offsets inside it, local tensor). An FSDP2 (ZeRO-3)
    parameter is a DTensor over the data-parallel ranks whose local tensor is one box of it (its dim-0 shard), at
    the offset its own placement gives; a plain tensor is all of it. DCP must be handed the local tensor: copying
    a checkpoint's chunk into the DTensor itself fails ("mixed torch.Tensor and DTensor")."""
    if isinstance(t, DTensor):
        _, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        return list(offset), t.to_local()
    return [0] * t.dim(), t


def _param_slices(p: nn.Parameter, mesh: Mesh, segment: tuple[int, torch.Tensor] | None = None,
                  local: torch.Tensor | None = None) -> Slices:
    """``p``'s box (tp / ep slice; under ZeRO-3 this rank's shard of it), or with ``segment`` (flat start, data)
    only that flat range of it; ``local``: the tensor standing for ``p``'s values (an optimizer state tensor
    shaped like it)."""
    tp_local_shape = list(p.shape)  # FSDP2: the DTensor's shape is the tp-local tensor's
    full, starts = layout_of(p).box(tp_local_shape, mesh.tp_rank, mesh.tp, mesh.ep_rank, mesh.ep)
    if segment is not None:
        start, data = segment
        return Slices(torch.Size(full), _flat_pieces(data, tp_local_shape, start, starts))
    offset, t = _own_part(local if local is not None else p.detach())
    t = _alias(t)
    return Slices(torch.Size(full), [(torch.Size([s + o for s, o in zip(starts, offset, strict=True)]), t)]
                  if t.numel() else [])


def sharded_model_state(model: nn.Module, mesh: Mesh,
                        segments: dict[str, tuple[int, torch.Tensor] | None] | None = None) -> dict[str, object]:
    """The model's state as this rank holds it. ``segments``: parameter name -> (flat start, local data) of the
    flat shard of it that this rank stands for (ZeRO-1/2's fp32 master shards, or their own segments of the
    replicated weights when saving), or None where it holds no shard of that parameter. A parameter not named in
    ``segments`` (frozen, so in no ZeRO shard; every parameter without an optimizer) is the part of its (tp / ep)
    box that the parameter itself holds: all of it, or under ZeRO-3 its FSDP2 shard, which needs no optimizer to
    be found (a model-only checkpoint loads into a ZeRO-3 model like any other)."""
    # state_dict first: FSDP2's pre-hooks put ZeRO-3 parameters left gathered (after an evaluation's forward, say)
    # back to their shards, the DTensors whose local tensors the optimizer updates.
    state = model.state_dict(keep_vars=True)
    params = dict(model.named_parameters(remove_duplicate=False))
    aliases = model.tied_aliases() if hasattr(model, "tied_aliases") else {}
    segments = segments or {}
    out: dict[str, object] = {}
    for key, value in state.items():
        if key in aliases:
            continue
        p = params.get(key)
        if p is None:  # a buffer: replicated, written once
            out[key] = value.detach()
        elif key in segments and segments[key] is not None:
            out[key] = _param_slices(p, mesh, segments[key])
        elif key in segments:  # a parameter of which this rank holds no shard
            out[key] = Slices(torch.Size(layout_of(p).box(list(p.shape), mesh.tp_rank, mesh.tp, mesh.ep_rank,
                                                          mesh.ep)[0]), [])
        else:
            out[key] = _param_slices(p, mesh)
    for alias, name in aliases.items():  # the same slices under both names, as the single model's state dict
        out[alias] = out[name]
    return out


def _segments(optimizer, data: list[torch.Tensor]) -> dict[str, tuple[int, torch.Tensor] | None]:
    """A ZeRO optimizer's segments by parameter name, each standing for ``data`` (None for a trainable parameter
    with no segment on this rank)."""
    out: dict[str, tuple[int, torch.Tensor] | None] = {name: None for name, _ in optimizer.named_params}
    for s, t in zip(optimizer.segments, data, strict=True):
        out[optimizer.named_params[s.owner][0]] = (s.start, t)
    return out


def sharded_optim_state(model: nn.Module, optimizer: torch.optim.Optimizer, mesh: Mesh) -> dict:
    """{'state': {single-model name: {'step': tensor, 'exp_avg': Slices, ...}}} as this rank holds it."""
    if hasattr(optimizer, "segments"):  # ZeRO 1/2/3: flat segments of the tp-local parameters
        state: dict[str, dict] = {}
        for t, seg in zip(optimizer.tensors, optimizer.segments, strict=True):
            name, p = optimizer.named_params[seg.owner]
            name = single_model_name(name, p)
            st = optimizer.inner.state[t]
            entry = state.setdefault(name, {"step": st["step"]})
            for k, v in st.items():
                if k == "step":
                    continue
                pieces = _param_slices(p, mesh, (seg.start, v))
                if k in entry:
                    entry[k].pieces.extend(pieces.pieces)
                else:
                    entry[k] = pieces
        return {"state": state}
    state = {}
    for name, p in model.named_parameters():
        st = optimizer.state.get(p)
        if not st:
            continue
        state[single_model_name(name, p)] = {
            k: (_param_slices(p, mesh, local=v) if torch.is_tensor(v) and v.shape == p.shape and v.ndim > 0
                else v) for k, v in st.items()}
    return {"state": state}


def error_feedback_state(optimizer, mesh: Mesh) -> dict:
    """A 1-bit optimizer's error-feedback buffers (megaloom/optim/onebit.py) as this rank holds them, under
    ``optim_local``: per parameter (single-model name), ``worker_error`` shaped [group size, *parameter] (each
    data-parallel rank its own row: the ranks' errors differ) and ``server_error`` shaped like the parameter (each
    rank the flat range of it that its chunk of the bucket holds, as a ZeRO segment). Layout-free in the bucket size
    and tp; the worker rows need the same data-parallel size to load (`local_state_fits`)."""
    out: dict[str, dict] = {}
    for p, size, rank, worker, server in optimizer.error_buffers():
        name = single_model_name(optimizer.names[id(p)], p)
        full, starts = layout_of(p).box(list(p.shape), mesh.tp_rank, mesh.tp, mesh.ep_rank, mesh.ep)
        rows = Slices(torch.Size([size, *full]), [(torch.Size([rank, *starts]), _alias(worker.unsqueeze(0)))])
        served = _param_slices(p, mesh, server) if server is not None else Slices(torch.Size(full), [])
        out[name] = {"worker_error": rows, "server_error": served}
    return out


def local_state_fits(state: dict, saved: dict) -> bool:
    """Whether a checkpoint's tensors (``saved``: DCP metadata, flat name -> its metadata) hold every tensor of
    ``state["optim_local"]`` at the same size."""
    for name, entry in state.get("optim_local", {}).items():
        for key, value in entry.items():
            md = saved.get(f"optim_local.{name}.{key}")
            if md is None or tuple(getattr(md, "size", ())) != tuple(value.size()):
                return False
    return True


def sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer | None, mesh: Mesh, save: bool = False,
                  with_optim: bool = True) -> dict:
    """{'model': ..., 'optim': ...} as this rank holds it (no collective): what a checkpoint writes and loads.

    ``save``: what this rank writes. With ZeRO-1/2 every data-parallel replica holds the same weights, and DCP
    would write each box once anyway; each rank then stands for the segment it updates (its ZeRO shard of the
    weights, 1/dp), so a staged save copies only that, and the boxes of the ranks tile every tensor without a
    duplicate. Loading (``save=False``) reads every replica's whole box into its parameters. ``with_optim=False``:
    the model's part only, but still into the fp32 master shards where the optimizer keeps them apart (the
    parameters may hold rounded, even bf16, weights: train.bf16_params)."""
    segments = None
    layout = type(getattr(optimizer, "layout", None)).__name__
    # ZeRO-3's parameters are their own shards (FSDP2 DTensors; `_own_part`): described by the model alone.
    if optimizer is not None and getattr(optimizer, "separate_masters", False):
        # ZeRO-1/2 gathering bf16: the exact weights are the fp32 master shards, not the rounded replicas.
        segments = _segments(optimizer, [t.detach() for t in optimizer.tensors])
    elif save and optimizer is not None and layout == "DataParallelGrads":
        segments = _segments(optimizer, [s.data for s in optimizer.segments])  # views of the parameters
    state: dict = {"model": sharded_model_state(model, mesh, segments)}
    if optimizer is not None and with_optim:
        state["optim"] = sharded_optim_state(model, optimizer, mesh)
        if hasattr(optimizer, "error_buffers"):  # 1-bit optimizers: each rank's own error-feedback buffers
            state["optim_local"] = error_feedback_state(optimizer, mesh)
    return state


def after_load(optimizer: torch.optim.Optimizer | None, loaded: dict) -> None:
    """What DCP could not load in place: a ZeRO optimizer keeps one step counter per segment (all equal), and
    the state dict named one of them per parameter."""
    if optimizer is None or "optim" not in loaded:
        return
    if hasattr(optimizer, "state_loaded"):
        optimizer.state_loaded()
    saved = loaded["optim"]["state"]
    if hasattr(optimizer, "segments"):
        for t, seg in zip(optimizer.tensors, optimizer.segments, strict=True):
            name, p = optimizer.named_params[seg.owner]
            optimizer.inner.state[t]["step"].copy_(saved[single_model_name(name, p)]["step"])
