"""Optimizer state offloaded to the host (``train.optimizer_offload``): ZeRO-Offload's split for AdamW.

What moves: the device keeps the weights (in the model's parameter dtype: fp32, or bf16 with train.bf16_params)
and the gradients; the host keeps, per rank, the fp32 master weights, AdamW's exp_avg and exp_avg_sq and one fp32
landing buffer for the gradients, the masters and the buffer pinned (page-locked) on an accelerator so that both
copies run asynchronously, plain memory on CPU. That is 12 bytes per parameter off the device (16 with separate
masters), at the price of 8 bytes per parameter over the host link each step (gradients down, weights up in fp32;
the cast to bf16 happens on the device, after the copy).

Each step: the gradients are copied down on a side stream of the device (after everything queued: the reduction,
the clip), chunk by chunk; a host thread runs torch's CPU AdamW (fused where this torch has the CPU kernel, else
foreach) on each chunk as soon as its gradients have landed, and copies its new weights up on the side stream.
One process or zero=0 data parallelism: the chunks are the model's in forward order (`forward_order_chunks`:
embedding, block 0, 1, ..., final norm and head) and the next forward's pre-hook of each module waits for its
chunk only (the host thread, then a stream wait): block i runs on the device while the host updates the blocks
after it. ZeRO-1/2 (each rank offloads its own shard: the flat buckets' 1/dp chunks): the chunks are the buckets,
in the order their parameter all-gathers are issued (the last bucket, the first layers, first); as soon as a
bucket's chunk is back on the device its all-gather is issued, so the gathers run while the host updates the next
buckets; the forward's hooks wait for them as without offload.

The arithmetic is AdamW's, elementwise, over 1-D masters: with the same kernel as the on-device step (foreach on
CPU) the update is bitwise the same; the fused CPU kernel differs by the float32 rounding of its own order
(tests/optim/test_offload.py). The clip coefficient is applied to the device gradients before they are copied.
Checkpoints: this optimizer presents ZeRO's face (``segments``, ``tensors``, ``inner``, ``separate_masters``),
whole parameters as segments at zero=0, so the weights are written from the fp32 masters and the state under
AdamW's keys: the same layout-free names as the on-device state, loadable by either.

Refused (config validation): LAMB, 1-bit and Muon (their own steps), ZeRO-3 / FSDP2, and
train.overlap_optimizer (this has its own overlap).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from megaloom import accelerator
from megaloom.config import ConfigError, TrainConfig
from megaloom.optim.overlapped_step import forward_order_chunks
from megaloom.optim.zero import register_param_waits, step_groups
from megaloom.parallel.data_parallel import Segment

CHUNK_ELEMENTS = 1 << 24  # 64 MiB of fp32: a chunk of the pipeline where the model gives no forward order


class HostOffloadOptimizer:
    """AdamW whose fp32 masters and moments live on the host. Behaves like a torch optimizer where the training
    loop touches one (``param_groups``, ``step()``, ``zero_grad()``); ``wait_all()`` before the weights are read
    outside a forward (TrainStep.settle)."""

    separate_masters = True  # the checkpoint reads and writes the weights through the fp32 masters

    def __init__(self, named_params: list[tuple[str, nn.Parameter]], segments: list[Segment],
                 grads_of: Callable[[], list[torch.Tensor | None]], targets: Callable[[], list[torch.Tensor]],
                 device: torch.device, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, chunks: Sequence[tuple[nn.Module, list[int]]] = (),
                 overlap: bool = False, layout: Any = None, fused: bool | None = None,
                 gathers: Sequence[Any] | None = None) -> None:
        """``grads_of``: each segment's device gradient now (None: no gradient this step); ``targets``: each
        segment's device weights (views the new values are copied into); ``chunks``: (module whose forward reads
        them, segment indices) in forward order; ``overlap``: the host step runs on a thread beside the next
        forward (needs ``chunks`` covering every segment); ``layout``: ZeRO-1/2's DataParallelGrads; ``gathers``:
        the layout's bucket each chunk is (issued once the chunk is back), one per chunk."""
        self.named_params, self.segments, self.layout = named_params, segments, layout
        self.mesh = getattr(layout, "mesh", None)
        self.device, self._grads_of, self._targets = device, grads_of, targets
        self.streams = accelerator.streams(device)
        self.side = self.streams.new_stream() if self.streams is not None else None
        self.tensors = [nn.Parameter(_host_master(s, device)) for s in segments]
        if hasattr(layout, "release_master_init"):
            layout.release_master_init()
        self.host_grads = [accelerator.host_buffer(t.numel(), device) for t in self.tensors]
        decay = [i for i, s in enumerate(segments) if named_params[s.owner][1].ndim >= 2]
        no_decay = [i for i, s in enumerate(segments) if named_params[s.owner][1].ndim < 2]
        split = [(idx, wd) for idx, wd in ((decay, weight_decay), (no_decay, 0.0)) if idx]
        fused = accelerator.host_fused_optimizer() if fused is None else fused
        self.inner = torch.optim.AdamW([{"params": [self.tensors[i] for i in idx], "weight_decay": wd}
                                        for idx, wd in split], lr=lr, betas=betas, eps=eps,
                                       weight_decay=weight_decay, fused=fused, foreach=None if fused else True)
        self._groups = self.inner.param_groups  # what the schedule sets; the thread steps restricted copies
        for t in self.tensors:  # eagerly (checkpoints load in place); plain memory: the moments never move
            self.inner.state[t] = {"step": torch.zeros((), dtype=torch.float32),
                                   "exp_avg": torch.zeros(t.shape), "exp_avg_sq": torch.zeros(t.shape)}
        if not chunks:  # no forward order: cut in order, so that copies still overlap the host arithmetic
            chunks = [(None, part) for part in step_groups(list(range(len(segments))),
                                                           [t.numel() for t in self.tensors], CHUNK_ELEMENTS)]
        self.chunks = [idx for _, idx in chunks]
        in_group = [{id(t) for t in g["params"]} for g in self._groups]
        self._chunk_groups = [[[self.tensors[i] for i in idx if id(self.tensors[i]) in ids] for ids in in_group]
                              for idx in self.chunks]
        self.overlap = overlap
        self.gathers = list(gathers) if gathers is not None else None
        if self.gathers is not None and (overlap or len(self.gathers) != len(self.chunks)):
            raise ValueError("gathers: one bucket per chunk, and only for the step run in the training thread")
        self._thread: threading.Thread | None = None
        self._ready: list[threading.Event] | None = None
        self._landed: dict[int, Any] = {}  # chunk -> the event of its upload (accelerator), until waited for
        self._error: BaseException | None = None
        self._hooks = []
        if overlap:
            for i, (module, _) in enumerate(chunks):
                self._hooks.append(module.register_forward_pre_hook(self._waiter(i)))

    # ------------------------------------------------------------------------------- the torch optimizer face

    @property
    def param_groups(self) -> list[dict]:
        return self._groups

    @property
    def state(self) -> dict:
        return self.inner.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        for _, p in self.named_params:
            p.grad = None

    def state_bytes(self) -> int:
        """Bytes of optimizer state on the device: none (`host_bytes` has them)."""
        return 0

    def host_bytes(self) -> int:
        """Host bytes this rank holds: the fp32 masters, the moments and the gradients' landing buffers."""
        moments = sum(v.numel() * v.element_size() for st in self.inner.state.values() for v in st.values()
                      if v.ndim > 0)
        return moments + sum(4 * t.numel() for t in self.tensors) + sum(4 * h.numel() for h in self.host_grads)

    # ------------------------------------------------------------------------------------------- the step

    @torch.no_grad()
    def step(self) -> None:
        self.wait_all()  # an update never overtakes the previous one
        if self.layout is not None:
            self.layout.wait_params()  # the previous gather reads this rank's chunk
        grads = self._grads_of()
        for t, h, g in zip(self.tensors, self.host_grads, grads, strict=True):
            t.grad = None if g is None else h  # (torch's AdamW skips a tensor without gradient, as on the device)
        # This step's hyper-parameters: the schedule may set the next learning rate while the thread still runs.
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in self._groups]
        fetched = self._download(grads)
        self._error = None
        if self.overlap:
            self._ready = [threading.Event() for _ in self.chunks]
            self._thread = threading.Thread(target=self._run, args=(hyper, fetched), daemon=True,
                                            name="megaloom-offload-step")
            self._thread.start()
            return
        self._run(hyper, fetched)
        self.wait_all()
        if self.layout is None:
            return
        if self.gathers is None:
            self.layout.publish_params(getattr(self, "overlap_param_gather", True))
        elif not getattr(self, "overlap_param_gather", True):
            self.layout.wait_params()

    def _download(self, grads: list[torch.Tensor | None]) -> list[Any] | None:
        """Copy the gradients into the host buffers, chunk by chunk; on an accelerator asynchronously on the side
        stream, returning each chunk's event (None on CPU: copied now)."""
        if self.side is None:
            for h, g in zip(self.host_grads, grads, strict=True):
                if g is not None:
                    h.copy_(g.reshape(-1))
            return None
        self.side.wait_stream(self.streams.current())  # the gradients, their reduction and the clip are done
        events = []
        with self.streams.use(self.side):
            for idx in self.chunks:
                for i in idx:
                    if grads[i] is not None:
                        self.host_grads[i].copy_(grads[i].reshape(-1), non_blocking=True)
                events.append(self.streams.event())
                events[-1].record(self.side)
        for g in grads:  # read on the side stream after the host drops them (zero_grad)
            if g is not None:
                g.record_stream(self.side)
        return events

    def _run(self, hyper: list[dict], fetched: list[Any] | None) -> None:
        """Every chunk in order: wait for its gradients, AdamW on the host, copy the weights up."""
        try:
            if self.overlap and accelerator.is_accelerator(self.device):
                accelerator.set_device(self.device)  # the thread's current device (per thread on CUDA)
            for i in range(len(self.chunks)):
                if fetched is not None:
                    fetched[i].synchronize()
                self._step_chunk(i, hyper)
                self._upload(i)
                if self.gathers is not None:  # (the training thread) the bucket's gather, after its upload
                    event = self._landed.pop(i, None)
                    if event is not None:
                        self.streams.current().wait_event(event)
                    self.layout.gather_bucket(self.gathers[i])
                if self._ready is not None:
                    self._ready[i].set()
        except BaseException as e:  # re-raised in the training thread (wait_all, or a forward's hook)
            self._error = e
            for ev in self._ready or ():
                ev.set()
            if not self.overlap:
                raise

    def _step_chunk(self, i: int, hyper: list[dict]) -> None:
        """One step of the inner AdamW over chunk ``i``'s masters (the same state; elementwise, so the chunks
        together are the whole step)."""
        groups = [{**h, "params": ps} for h, ps in zip(hyper, self._chunk_groups[i], strict=True) if ps]
        if not groups:  # (a bucket whose chunk on this rank is padding only)
            return
        self.inner.param_groups = groups
        try:
            self.inner.step()
        finally:
            self.inner.param_groups = self._groups

    def _upload(self, i: int) -> None:
        """Chunk ``i``'s new fp32 weights into the device's (cast there to the parameters' dtype)."""
        targets = self._targets()
        if self.side is None:
            for j in self.chunks[i]:
                targets[j].copy_(self.tensors[j].detach())
            return
        with self.streams.use(self.side):
            for j in self.chunks[i]:
                targets[j].copy_(self.tensors[j].detach(), non_blocking=True)
            event = self.streams.event()
            event.record(self.side)
        self._landed[i] = event

    def _waiter(self, i: int):
        @torch.compiler.disable  # a compiled block calls its hooks inside its frame: keep this one eager
        def wait(_module, _args) -> None:
            ready = self._ready
            if ready is not None and i < len(ready):
                ready[i].wait()
                if self._error is not None:
                    self.wait_all()  # raises it
            event = self._landed.pop(i, None)
            if event is not None:
                self.streams.current().wait_event(event)
        return wait

    def wait_all(self) -> None:
        """The whole update is done: the host thread joined, the device's stream waits for every upload."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._ready = None
        if self.side is not None:
            self.streams.current().wait_stream(self.side)
        self._landed.clear()
        error, self._error = self._error, None
        if error is not None:
            raise error

    # ---------------------------------------------------------------------------------------- checkpoints

    @torch.no_grad()
    def weights_loaded(self, masters_loaded: bool) -> None:
        """After a load: ``masters_loaded`` (a checkpoint wrote the masters) or not (the device weights were
        written: the masters copy them). Then the device weights come from the masters (ZeRO: gathered)."""
        self.wait_all()
        if self.layout is not None:
            self.layout.wait_params()
        targets = self._targets()
        if not masters_loaded:
            for t, d in zip(self.tensors, targets, strict=True):
                t.detach().copy_(d)
        for i in range(len(self.chunks)):
            self._upload(i)
        self.wait_all()
        if self.layout is not None:
            self.layout.publish_params(overlap=False)

    def remove(self) -> None:
        self.wait_all()
        for h in self._hooks:
            h.remove()


def _host_master(s: Segment, device: torch.device) -> torch.Tensor:
    """A segment's fp32 master on the host: the build's fp32 values where the device holds bf16 weights, else a
    copy of the (fp32) weights."""
    out = accelerator.host_buffer(s.data.numel(), device)
    out.copy_(s.master_init if s.master_init is not None else s.data.reshape(-1))
    return out


# ------------------------------------------------------------------------------------------------ building


def check_offload(t: TrainConfig, zero: int) -> None:
    """The combinations train.optimizer_offload takes (also in config validation; here for direct callers)."""
    if t.optimizer != "adamw":
        raise ConfigError(f"train.optimizer_offload=true runs torch's AdamW on the host; train.optimizer="
                          f"{t.optimizer} has its own step. Set train.optimizer=adamw or "
                          "train.optimizer_offload=false.")
    if zero == 3:
        raise ConfigError("train.optimizer_offload=true with parallel.zero=3: FSDP2 shards the parameters themselves "
                          "(its CPUOffloadPolicy is not wired here); use parallel.zero=1 or 2 (each rank offloads "
                          "its shard) or train.optimizer_offload=false.")


def bucket_chunks(grads: Any, segments: list[Segment]) -> tuple[list[tuple[None, list[int]]], list[Any]]:
    """ZeRO-1/2: the segments grouped by the bucket they lie in, in the order the parameter all-gathers are issued
    (the last bucket first: it holds the first layers); (chunks, each chunk's bucket)."""
    def bucket_of(s: Segment) -> int:
        ptr = s.data.data_ptr()
        for k, b in enumerate(grads.buckets):
            start = b.param_data.data_ptr()
            if start <= ptr < start + b.param_data.numel() * b.param_data.element_size():
                return k
        raise ValueError("a shard segment outside every bucket")

    of = [bucket_of(s) for s in segments]
    order = range(len(grads.buckets) - 1, -1, -1)  # every bucket: one whose chunk is all padding here still gathers
    chunks = [(None, [i for i, k in enumerate(of) if k == b]) for b in order]
    return chunks, [grads.buckets[b] for b in order]


def build_offloaded(model: nn.Module, grads: Any, t: TrainConfig, device: torch.device, zero: int = 0,
                    overlap: bool | None = None, whole_modules: Sequence[nn.Module] = (),
                    fused: bool | None = None) -> HostOffloadOptimizer:
    """The offloaded AdamW for ``parallel.zero``: whole parameters (0; ``grads`` None or zero-0 buckets) or this
    rank's ZeRO-1/2 shard of ``grads``' buckets. ``overlap`` (default: where the device has streams and the step
    is whole parameters of a model with blocks): the host step beside the next forward. ``fused``: the host
    kernel (default: torch's fused CPU AdamW where it exists; False: foreach, the on-device step's on CPU)."""
    check_offload(t, zero)
    hyper = dict(lr=t.lr, betas=(t.beta1, t.beta2), eps=1e-8, weight_decay=t.weight_decay, fused=fused)
    if zero in (1, 2):
        segments = grads.shard_segments()
        chunks, gathers = bucket_chunks(grads, segments)
        opt = HostOffloadOptimizer(grads.named_params, segments, lambda: grads.segment_grads(segments),
                                   lambda: [s.data for s in segments], device, layout=grads, chunks=chunks,
                                   gathers=gathers, **hyper)
        opt._hooks += register_param_waits(grads, whole_modules)
        return opt
    seen: set[int] = set()
    named = []
    for n, p in model.named_parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            named.append((n, p))
    params = [p for _, p in named]
    segments = [Segment(i, 0, p.detach().reshape(-1), None) for i, p in enumerate(params)]
    chunks: list[tuple[nn.Module, list[int]]] = []
    if hasattr(model, "blocks") and hasattr(model, "embedding_parts"):
        where = {id(p): i for i, p in enumerate(params)}
        chunks = [(m, [where[id(p)] for p in ps]) for m, ps in forward_order_chunks(model)]
    if overlap is None:
        overlap = bool(chunks) and accelerator.streams(device) is not None
    # p.data is read at each copy (a load may give a parameter new storage)
    return HostOffloadOptimizer(named, segments, lambda: [p.grad for p in params],
                                lambda: [p.detach().view(-1) for p in params], device,
                                chunks=chunks, overlap=overlap and bool(chunks), **hyper)
