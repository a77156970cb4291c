"""What autograd really saves for backward: the measurement the memory plan's activation model is checked against.

`megaloom.planning.memory_plan` enumerates saved tensors from the config; the functions here count them by
running a forward under `torch.autograd.graph.saved_tensors_hooks`. A contributor adding a model family (or
changing a module) compares the two: tests/planning/test_family_memory_plan.py does it for every registered
family, so a family whose block saves something the plan does not know fails there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import torch
from torch import nn


def is_weight_cast(t: torch.Tensor) -> bool:
    """A low-precision copy of a parameter made by autocast (or an explicit .to): a ToCopy of a leaf, through
    views. The memory plan counts these as weight casts (`memory_plan.weight_cast_bytes`), not activations."""
    base = t._base if t._base is not None else t
    fn = base.grad_fn
    if fn is None or fn.name() != "ToCopyBackward0":
        return False
    nxt = fn.next_functions[0][0]
    while nxt is not None and nxt.name() in ("SelectBackward0", "TBackward0", "ViewBackward0"):
        nxt = nxt.next_functions[0][0]
    return nxt is not None and hasattr(nxt, "variable")


class SavedStorages:
    """Context manager: records every distinct storage autograd saves inside it (by ``data_ptr``, counted once
    and whole, as the allocator holds it), except those of the tensors in ``exclude``. ``activations`` and
    ``weight_casts`` are the bytes of what it saw."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()):
        self._own = {t.untyped_storage().data_ptr() for t in exclude}
        self._seen: dict[int, tuple[int, bool]] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        ptr = s.data_ptr()
        if ptr not in self._own and ptr not in self._seen:
            self._seen[ptr] = (s.nbytes(), is_weight_cast(t))
        return t

    def __enter__(self) -> SavedStorages:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    @property
    def activations(self) -> int:
        return sum(n for n, cast in self._seen.values() if not cast)

    @property
    def weight_casts(self) -> int:
        return sum(n for n, cast in self._seen.values() if cast)


def measured_block_activation_bytes(block: nn.Module, x: torch.Tensor,
                                    rope: tuple[torch.Tensor, torch.Tensor] | None = None, *,
                                    autocast: torch.dtype | None = None) -> int:
    """Bytes one forward of ``block(x, rope)`` (a `megaloom.models.transformer.Block`, in the state it is in:
    recomputation flags, train/eval) saves for backward: the distinct storages autograd's saved-tensor hooks
    see, each counted once and whole. Not counted: the block's parameters and buffers, the RoPE tables (the
    model's buffers) and, under ``autocast`` (a dtype: autocast on x's device), autocast's copies of the
    weights, which the plan counts separately as weight casts. ``x`` itself is counted when something saves
    it (the first norm does: the plan's fp32 residual input). It is taken as a block input in training is: a
    non-leaf copy that requires grad (what is saved depends on it: a norm keeps less for an input without gradient).

    This is what `memory_activations.block_activation_bytes` predicts for the same config, tokens = b x t and
    x's device type (the CPU save-sets: composite RMSNorm, the CPU flash-attention kernel)."""
    exclude = [*block.parameters(), *block.buffers(), *(rope or ())]
    # Not a leaf, as in training (a block's input comes from the embedding or the block before): autocast caches
    # its casts of leaf tensors that require grad, so a post-norm block (whose attention reads the block input
    # itself) would share one bf16 copy among q, k and v where training makes three.
    with torch.enable_grad():
        x = x.detach().clone().requires_grad_() * 1.0
    auto = (torch.autocast(x.device.type, dtype=autocast) if autocast is not None else contextlib.nullcontext())
    with torch.enable_grad(), SavedStorages(exclude) as saved, auto:
        out = block(x, rope)  # held until counted: its graph keeps the saved storages (and their addresses) alive
    del out
    return saved.activations
