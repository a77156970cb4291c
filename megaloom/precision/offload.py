"""Activation offload (`train.offload_activations`): tensors saved for backward wait in CPU memory.

`torch.autograd.graph.saved_tensors_hooks` sees every tensor autograd keeps for backward. `offload_saved`
copies the large activations of a CUDA forward into pinned host memory (non-blocking, on the current stream,
so the copy is ordered after the kernel that produced the tensor) and brings them back when backward unpacks
them. Parameters and their views stay where they are (they are on the GPU anyway, copying them only costs),
and so do small tensors, where a transfer costs more than it saves.

Why not `torch.autograd.graph.save_on_cpu`: it copies every saved tensor, parameters included.
This is the simple, synchronous-with-the-stream form: memory falls by the activations' size, the time cost is
the PCIe traffic (about 2 x the activation bytes per step). Combine with `train.recompute=selective` or with
fewer micro-batches in flight when that traffic matters.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from megaloom import accelerator
from megaloom.accelerator import CUDA

MIN_BYTES = 1 << 20  # tensors below 1 MiB stay on the device
OFFLOAD_FROM = {CUDA}  # device types whose activations move, measured on CUDA (tests add "cpu" to exercise the hooks)


def _is_param(t: torch.Tensor) -> bool:
    """A parameter, a view of one, or autocast's cached low-precision copy of one (kept by autocast until the
    forward ends, so moving it would only add traffic)."""
    if isinstance(t, nn.Parameter) or (t._base is not None and isinstance(t._base, nn.Parameter)):
        return True
    fn = t.grad_fn
    return (fn is not None and type(fn).__name__ == "ToCopyBackward0" and len(fn.next_functions) > 0
            and type(fn.next_functions[0][0]).__name__ == "AccumulateGrad")


def _pack(t: torch.Tensor):
    if t.device.type not in OFFLOAD_FROM or _is_param(t) or t.numel() * t.element_size() < MIN_BYTES:
        return t
    host = torch.empty(t.size(), dtype=t.dtype, pin_memory=accelerator.pin_memory(t.device))
    host.copy_(t, non_blocking=True)
    return (t.device, host)


def _unpack(packed):
    if isinstance(packed, torch.Tensor):
        return packed
    device, host = packed
    return host.to(device, non_blocking=True)


def offload_saved(enabled: bool = True):
    """Context manager: inside it, large saved activations of CUDA tensors live in pinned CPU memory."""
    if not enabled:
        return contextlib.nullcontext()
    return torch.autograd.graph.saved_tensors_hooks(_pack, _unpack)
