"""The optimizer step beside the next forward (train.overlap_optimizer): a memory-bound update under compute.

AdamW reads and writes 28 bytes per fp32 parameter: on an H200 it is 15 ms of a 256 ms llama3-1b step (6%), run
while nothing else runs, although the next forward needs the embedding's and block 0's new weights first and the
head's last. Here the update runs on a side stream of the device in that order, chunk by chunk (embedding, block 0,
1, ..., final norm and head), and the main stream waits for a chunk's event only just before the module that reads it
(forward pre-hooks, kept out of torch.compile): block i's forward overlaps the updates of the blocks after it.

The arithmetic is the optimizer's own: each chunk is one `optimizer.step()` over a view of the parameter groups
holding that chunk's parameters only, so the fused kernel, its state (exp_avg, exp_avg_sq, step), the clip
coefficient folded in as `grad_scale` and the checkpointed state dict are those of the unchunked step; an
elementwise update split into chunks is the same update. The first step runs unchunked (it creates the state).

What the side stream still reads when the host moves on is protected: each gradient and the clip coefficient are
marked as used on the side stream (`record_stream`), so the caching allocator does not hand their memory to the
next forward before the update has read them. Anything that reads or writes the weights outside a forward (a
checkpoint save, a rollback, the end of training) calls `wait_all()` first. One process or data parallelism
without ZeRO (zero=0), no pipeline: the config refuses the rest. On CPU (tests) the same chunks run in order on
the one stream. Streams and events are the device module's (`accelerator.streams`: torch.cuda's on CUDA, where this
was measured; another accelerator whose module has streams takes the same path, untested).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from megaloom import accelerator


def forward_order_chunks(model: nn.Module) -> list[tuple[nn.Module, list[nn.Parameter]]]:
    """(the module before whose forward the chunk must be updated, its parameters), in the order a forward reads
    them: the embedding (waited for as the model's forward starts), each block, then the final norm and head
    (waited for at the final norm). Parameters of any other module (a pooler, an image encoder) join the first
    chunk, so that they are ready before anything runs. A parameter shared by two chunks (a tied head) goes with
    the first."""
    seen: set[int] = set()

    def take(params: Iterable[nn.Parameter]) -> list[nn.Parameter]:
        out = []
        for p in params:
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
        return out

    blocks = [block for _, block in model.blocks()]
    last = [m for m in (getattr(model, "norm", None), getattr(model, "head", None)) if m is not None]
    in_order = {id(p) for m in blocks + last for p in m.parameters()}
    first = take([p for m in (getattr(model, n) for n in model.embedding_parts()) for p in m.parameters()]
                 + [p for p in model.parameters() if id(p) not in in_order])
    chunks: list[tuple[nn.Module, list[nn.Parameter]]] = [(model, first)]
    chunks += [(block, take(block.parameters())) for block in blocks]
    if last:
        chunks.append((last[0], take(p for m in last for p in m.parameters())))
    return [(m, ps) for m, ps in chunks if ps]


class OverlappedStep:
    """`step()` in place of `optimizer.step()`; `wait_all()` before the weights are used outside a forward."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device):
        self.optimizer, self.device = optimizer, device
        self.chunks = forward_order_chunks(model)
        self.streams = accelerator.streams(device)  # None on CPU: the chunks run in order on the one stream
        self.side = self.streams.new_stream() if self.streams is not None else None
        self.pending: dict[int, Any] = {}  # chunk -> its update's event, until a forward waits for it
        # Each chunk's parameters per optimizer group, split once (the groups' parameter lists never change).
        chunk_ids = [{id(p) for p in params} for _, params in self.chunks]
        self.group_params = [[[p for p in g["params"] if id(p) in ids] for g in optimizer.param_groups]
                             for ids in chunk_ids]
        self._ready = False  # the optimizer state exists (after the first, unchunked step)
        self._hooks = []
        for i, (module, _) in enumerate(self.chunks):
            self._hooks.append(module.register_forward_pre_hook(self._waiter(i)))

    def _waiter(self, i: int):
        @torch.compiler.disable  # a compiled block calls its hooks inside its compiled frame: keep this one eager
        def wait(_module, _args) -> None:
            event = self.pending.pop(i, None)
            if event is not None:
                self.streams.current().wait_event(event)
        return wait

    def _states_ready(self) -> bool:
        if not self._ready:
            state = self.optimizer.state
            self._ready = all(len(state[p]) > 0 for _, ps in self.chunks for p in ps if p.grad is not None)
        return self._ready

    def step(self) -> None:
        """The update, chunk by chunk; on an accelerator queued on the side stream after everything queued so far."""
        self.wait_all()  # an update never overtakes the previous one (a step without a forward in between)
        if not self._states_ready():  # the first step creates the optimizer state: unchunked, on the main stream
            self.optimizer.step()
            return
        if self.side is None:
            for i in range(len(self.chunks)):
                self._step_chunk(i)
            return
        main = self.streams.current()
        self.side.wait_stream(main)  # the gradients, their reduction and the clip coefficient are ready
        scale = getattr(self.optimizer, "grad_scale", None)
        with self.streams.use(self.side):
            for i in range(len(self.chunks)):
                self._step_chunk(i)
                event = self.streams.event()
                event.record(self.side)
                self.pending[i] = event
        # Read on the side stream after the host drops them (zero_grad, the next step's clip coefficient).
        for _, params in self.chunks:
            for p in params:
                if p.grad is not None:
                    p.grad.record_stream(self.side)
        if isinstance(scale, torch.Tensor):
            scale.record_stream(self.side)

    def _step_chunk(self, i: int) -> None:
        """One `optimizer.step()` over the groups restricted to chunk ``i`` (same hyper-parameters, same state)."""
        opt = self.optimizer
        groups = opt.param_groups
        opt.param_groups = [{**g, "params": ps} for g, ps in zip(groups, self.group_params[i], strict=True)]
        try:
            opt.step()
        finally:
            opt.param_groups = groups

    def wait_all(self) -> None:
        """The main stream waits for every update still pending (a GPU-side wait: no host sync)."""
        for event in self.pending.values():
            self.streams.current().wait_event(event)
        self.pending.clear()

    def remove(self) -> None:
        self.wait_all()
        for h in self._hooks:
            h.remove()
