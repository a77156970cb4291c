"""A fake process group that hands back garbage, as it does on a GPU.

torch's fake backend (the dry run's) moves no data: a receive buffer keeps whatever its allocator left there. On
a CPU that is often zeros or the sender's own bytes, so a dry run that reads such a buffer on the host passes on
CPU and dies on the GPU (a pickled object that unpickles as "invalid load key", a split size that is negative).
`install()` makes the CPU behave like the GPU's worst case, for every collective megaloom may issue over a fake
group: object exchanges raise what a GPU's garbage raises, and integer results (the only ones a rank turns
into sizes, indices or decisions on the host) are overwritten with a negative number. Floating-point results
are left alone: they only flow on through the model, and a dry run measures time and memory, not values.

Use it in a fresh process (a subprocess), before the dry run; it patches torch.distributed's functions.
"""

from __future__ import annotations

import pickle
from functools import wraps

import torch
import torch.distributed as dist

GARBAGE = -987654321

# collective -> the positional index of (or keyword for) the tensor(s) the rank reads back
_TENSOR_OUTPUTS = {
    "all_reduce": (0, "tensor"),
    "broadcast": (0, "tensor"),
    "all_to_all_single": (0, "output"),
    "all_gather_into_tensor": (0, "output_tensor"),
    "all_gather_single": (0, "output_tensor"),
    "reduce_scatter_tensor": (0, "output"),
    "reduce_scatter_single": (0, "output"),
    "all_gather": (0, "tensor_list"),
    "all_to_all": (0, "output_tensor_list"),
}
_OBJECT_EXCHANGES = ("all_gather_object", "gather_object", "broadcast_object_list", "scatter_object_list")


def _fake(kwargs: dict) -> bool:
    group = kwargs.get("group")
    return dist.get_backend(group) == "fake"


def _spoil(t) -> None:
    if isinstance(t, (list, tuple)):
        for x in t:
            _spoil(x)
    elif isinstance(t, torch.Tensor) and not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool:
        t.fill_(GARBAGE)


def _tensor_wrapper(fn, index: int, key: str):
    @wraps(fn)
    def call(*args, **kwargs):
        work = fn(*args, **kwargs)
        if _fake(kwargs):
            _spoil(args[index] if len(args) > index else kwargs.get(key))
        return work
    return call


def _object_wrapper(fn):
    @wraps(fn)
    def call(*args, **kwargs):
        if _fake(kwargs):
            raise pickle.UnpicklingError(f"invalid load key, '\\x9c' ({fn.__name__} over a fake group: garbage)")
        return fn(*args, **kwargs)
    return call


def install() -> None:
    """Patch torch.distributed (and megaloom's captured aliases of it) so that fake groups return garbage."""
    import megaloom.parallel.comm as comm
    import megaloom.parallel.host_group as host_group

    for name, (index, key) in _TENSOR_OUTPUTS.items():
        if hasattr(dist, name):
            setattr(dist, name, _tensor_wrapper(getattr(dist, name), index, key))
    for name in _OBJECT_EXCHANGES:
        setattr(dist, name, _object_wrapper(getattr(dist, name)))
    gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    for module in (comm, host_group):
        if hasattr(module, "_all_gather_single"):
            module._all_gather_single = gather_single
        if hasattr(module, "_reduce_scatter_single"):
            module._reduce_scatter_single = scatter_single
