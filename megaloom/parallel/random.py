"""Dropout randomness under tensor parallelism.

Which ranks must draw the same dropout mask?
  * Replicated activations (the residual stream without sequence parallelism, the embedding output) are
    computed redundantly by every tp rank and must stay bit-identical, so their dropout uses the default
    stream, seeded equally on all tp ranks (`dropout_seed`).
  * Sharded activations (attention probabilities of the local heads; with sequence parallelism, the
    residual stream of the local tokens) are different data on each tp rank and should get independent
    masks, otherwise every rank would drop the same pattern. They run inside ``tracker.fork("tp")``.

A forked stream is not a stored generator state (as in Megatron) but a function of the default stream:
fork draws one number from the default CPU generator, identically on every rank, mixes in the stream's
per-rank salt, seeds the default generators with the result for the duration of the block and then
restores them. The point: torch.utils.checkpoint saves and restores the default RNG state around
recomputation, so a recomputed forked block replays the same mask without knowing about the tracker.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from megaloom import accelerator

if TYPE_CHECKING:
    from megaloom.parallel.mesh import Mesh

_MIX = 0x9E3779B97F4A7C15  # 2^64 / golden ratio: spreads consecutive salts far apart
_SEED_SPACE = 2**62


def dropout_seed(seed: int, mesh: Mesh) -> int:
    """Seed for the default stream after model init: equal across tp ranks, different across pp/dp/cp ranks
    (their activations are different data)."""
    index = (mesh.pp_rank * mesh.dp + mesh.dp_rank) * mesh.cp + mesh.cp_rank
    return (seed + index * 1_000_003) % _SEED_SPACE


class RNGTracker:
    """Named dropout streams; ``with tracker.fork("tp"):`` makes dropout differ across tp ranks."""

    def __init__(self, salts: dict[str, int] | None = None, device: torch.device | str = "cpu") -> None:
        self._salts: dict[str, int] = dict(salts or {})
        # Dropout on an accelerator's tensor draws from that device's generator, so that one is forked too.
        self.device = torch.device(device)
        self._device_rng = accelerator.device_rng(self.device)  # None on CPU

    @classmethod
    def for_mesh(cls, mesh: Mesh) -> RNGTracker:
        return cls({"tp": mesh.tp_rank}, mesh.device)

    def add(self, name: str, salt: int) -> None:
        """Register a stream; ranks that must draw differently get different salts."""
        if name in self._salts:
            raise ValueError(f"RNG stream {name!r} already exists")
        self._salts[name] = salt

    def names(self) -> list[str]:
        return list(self._salts)

    @contextmanager
    def fork(self, name: str = "tp") -> Iterator[None]:
        if name not in self._salts:
            raise KeyError(f"unknown RNG stream {name!r}; known: {', '.join(self._salts) or 'none'}")
        # One draw: advances the default stream equally on all ranks (and is replayed by checkpointing).
        base = int(torch.randint(0, _SEED_SPACE, (1,)).item())
        seed = (base + (self._salts[name] + 1) * _MIX) % _SEED_SPACE
        cpu_state = torch.get_rng_state()
        device_rng = self._device_rng
        saved = device_rng.fork(seed) if device_rng is not None else None
        torch.default_generator.manual_seed(seed)
        try:
            yield
        finally:
            torch.set_rng_state(cpu_state)
            if device_rng is not None:
                device_rng.restore(saved)


class ForkedDropout(nn.Module):
    """nn.Dropout whose mask comes from a tracker stream (for activations sharded across tp ranks)."""

    def __init__(self, p: float, tracker: RNGTracker, stream: str = "tp") -> None:
        super().__init__()
        self.p, self.tracker, self.stream = p, tracker, stream

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        with self.tracker.fork(self.stream):
            return F.dropout(x, self.p, training=True)

    def extra_repr(self) -> str:
        return f"p={self.p}, stream={self.stream!r}"


class ForkedCall:
    """Wraps a callable (the attention core, whose SDPA applies dropout to the local heads) in a fork."""

    def __init__(self, fn, tracker: RNGTracker, stream: str = "tp") -> None:
        self.fn, self.tracker, self.stream = fn, tracker, stream

    def __call__(self, *args, **kwargs):
        with self.tracker.fork(self.stream):
            return self.fn(*args, **kwargs)
