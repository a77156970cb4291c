"""Data parallelism: gradients accumulate in contiguous fp32 buckets and are reduced while backward still runs.

Every trainable parameter gets ``p.main_grad``, a view into one of a few flat fp32 buffers ("buckets"). A
``register_post_accumulate_grad_hook`` adds each fresh ``p.grad`` into ``p.main_grad`` and frees it, so
gradients of all micro-batches accumulate in the buckets. Buckets are filled in reverse parameter order,
the order in which backward produces gradients.

Nothing is communicated during the first micro-batches of a step. The caller arms the last one with
`start_last_microbatch()`; from then on a bucket's reduction is issued asynchronously as soon as every one
of its parameters has its gradient, strictly in bucket order (so all ranks issue the same collectives in
the same order, as DDP does), and `finish()` issues any bucket still missing (a parameter that got no
gradient) and waits for all. Each bucket is reduced exactly once per step; `stats` counts it.

- zero=0: each bucket is all-reduced (averaged); afterwards ``p.grad`` is ``p.main_grad`` so the usual
  optimizer, `sync_tp_grads` and clipping see full gradients.
- zero>=1: each bucket (padded to a multiple of the data-parallel size) is reduce-scattered: this rank keeps
  its 1/dp chunk of every bucket. With zero=1 that chunk is the bucket's own (Megatron's in-place
  reduce-scatter: the output is this rank's chunk of the input), so the reduced gradient shard costs no memory
  of its own; on gloo the bucket is all-reduced in place (`comm.reduce_scatter_async` with ``scratch``: no
  copy of it is made). Parameters are moved into buffers of the same layout, so after the sharded optimizer
  (megaloom.optim.zero) has updated this rank's chunk, one in-place all-gather per bucket refreshes every
  replica's weights.
- zero=2 reduce-scatters into ``grad_shard``, one contiguous tensor of the chunks, and releases the full-size
  buckets as soon as they are reduced, allocating them again at the first gradient of the next step. Honest
  memory: with gradient accumulation the full buckets must live from the first backward of a step to the end of
  the last (the reduction waits for the last micro-batch), so the peak is that of zero=1 plus the 1/dp shard;
  what zero=2 saves is the full gradient between the reduction and the next step's first backward (optimizer
  step, all-gather, next forward): then only ``grad_shard`` (1/dp) exists.

Tensor parallelism: a tp-sharded parameter's gradient is its local shard; the buckets of tp peers have the
same layout (same local shapes in the same order), so the tp fix-ups of `sync_tp_grads` (sequence-parallel
norms, replicated KV heads) can run after the data-parallel reduction on the reduced elements: zero=0
calls it on ``p.grad`` (the main grads), zero>=1 on views of the reduced chunks. Both operations are sums over
disjoint groups, so their order does not matter.

Pipeline parallelism: the executor calls `start_last_microbatch(params)` once per model chunk, just before the
computation that writes that chunk's last weight gradients (with interleaved stages a rank's chunks finish at
different times: each chunk's buckets start reducing as soon as that chunk is done), and `finish()` after the
schedule. The embedding tied to the head across the first and last stage (``tied``) gets a bucket of its own on
both stages, so both lay it out identically: after the data-parallel reduction its gradient (the whole bucket
with zero=0, this rank's chunk with zero>=1) is summed over the two-rank ``tied_group``. Averaging over dp and
summing over the two stages commute, so this equals the single model's gradient, and with ZeRO only 1/dp of the
embedding crosses between the stages. The norm counts the last stage's copy (``tied_copy``) zero times.
The data-parallel group is ``mesh.dp_cp_group`` (context parallelism also splits the batch).

Local steps (1-bit Adam / LAMB after their warm-up, megaloom/optim/onebit.py): while ``local_steps()`` says so, buckets
are not reduced at all. Each rank keeps its own gradient (tp fix-ups and the tied-embedding sum still run: they
are sums over other groups), the optimizer exchanges its compressed momentum instead, and `clip` takes the
root-mean-square over the data-parallel ranks of each rank's own gradient norm (one scalar all-reduce) as the norm,
so every rank scales its gradient by the same coefficient. ``pad_multiple``: buckets are padded to a multiple of
the group size times it (8 for the compressed exchange, whose chunks are whole bytes of sign bits).

Parameter all-gathers (zero>=1) move ``param_gather_dtype``: float32 by default; bfloat16 when training in bf16
halves their bytes. Then each replica holds the bf16-rounded weights (what autocast feeds the matmuls anyway,
and what Megatron's bf16 parameters are) and the optimizer keeps separate fp32 master shards
(megaloom.optim.zero.ShardedOptimizer).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from megaloom.config import ConfigError
from megaloom.models.moe import MoE
from megaloom.parallel import comm
from megaloom.parallel.expert import is_expert_param
from megaloom.parallel.grad_fusion import FusedEmbedding, FusedLinear
from megaloom.parallel.grad_norm import DeviceConstants, global_grad_norm
from megaloom.parallel.layout import copy_layout
from megaloom.parallel.mesh import Mesh
from megaloom.parallel.tensor import sync_tp_grads
from megaloom.parallel.tp_layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

DEFAULT_BUCKET_MB = 25.0
# A ZeRO shard's optimizer step runs over groups of about this many elements (optim/zero.py's `step_groups`): 16 MiB
# of fp32, the foreach AdamW's temporary per group (CPU), beyond one segment. Here, beside the buckets it cuts and
# below both that step and the memory plan that predicts its temporary.
STEP_GROUP_ELEMENTS = 1 << 22


def param_gather_dtype(param_gather: str, precision: str) -> torch.dtype:
    """parallel.param_gather resolved for a training precision (the one rule; the trainer, the memory plan and the
    step-time planner ask it): at auto, the compute dtype of bf16 (and of fp8, whose other ops run in bf16), with
    fp32 master shards kept apart; fp32 at param_gather=fp32 and under fp32 or fp16 (fp16 keeps fp32 parameters:
    its range is too narrow for weights without a scale)."""
    return torch.bfloat16 if param_gather == "auto" and precision in ("bf16", "fp8") else torch.float32


def plan_buckets(numels: list[int], bucket_numel: int, world: int) -> list[tuple[list[int], list[int], int]]:
    """Group parameters (given by element count, in model order) into buckets, last parameter first.

    A bucket is closed once it holds at least ``bucket_numel`` elements; a parameter is never split. Returns
    (parameter indices, element offsets inside the bucket, padded size) per bucket; the padded size is a
    multiple of ``world`` so that every rank's chunk has the same length.
    """
    buckets: list[tuple[list[int], list[int], int]] = []
    idx: list[int] = []
    offs: list[int] = []
    used = 0
    for i in reversed(range(len(numels))):
        idx.append(i)
        offs.append(used)
        used += numels[i]
        if used >= bucket_numel:
            buckets.append((idx, offs, math.ceil(used / world) * world))
            idx, offs, used = [], [], 0
    if idx:
        buckets.append((idx, offs, math.ceil(used / world) * world))
    return buckets


def plan_grouped_buckets(numels: list[int], kinds: list, bucket_numel: int,
                         worlds: dict) -> list[tuple[list[int], list[int], int, object]]:
    """`plan_buckets` where parameters of different kinds (dense / expert / tied across stages) never share a
    bucket: each run of equal kind (in backward order) is planned on its own, padded to its group's size.
    Returns (indices, offsets, padded, kind) per bucket, still last parameter first."""
    runs: list[list[int]] = []
    for i in reversed(range(len(numels))):
        if runs and kinds[runs[-1][-1]] == kinds[i]:
            runs[-1].append(i)
        else:
            runs.append([i])
    out = []
    for run in runs:
        ascending = run[::-1]
        for idx, offs, padded in plan_buckets([numels[i] for i in ascending], bucket_numel, worlds[kinds[run[0]]]):
            out.append(([ascending[j] for j in idx], offs, padded, kinds[run[0]]))
    return out


@dataclass(eq=False)
class Bucket:
    index: int
    params: list[nn.Parameter]
    offsets: list[int]  # element offset of each parameter in the bucket
    padded: int  # elements, a multiple of the reducing group's size
    shard_offset: int  # where this rank's chunk of the bucket lives in `grad_shard` (zero 2)
    group: object = None  # reducing group: the data-parallel group, or edp for expert weights (ep > 1)
    size: int = 1  # ranks in `group`
    rank: int = 0  # this rank's index in `group`
    data: torch.Tensor | None = None  # main grads [padded]; None while released (zero 2)
    param_data: torch.Tensor | None = None  # zero >= 1: the parameters' storage [padded]
    pending: int = 0  # parameters still without a gradient in the armed backward
    work: comm.Pending | None = None  # the reduction in flight
    gather: comm.Pending | None = None  # zero >= 1: the parameter all-gather in flight
    gather_buf: torch.Tensor | None = None  # its low-precision landing buffer (param_gather_dtype != fp32)
    master_init: torch.Tensor | None = None  # bf16 parameters: this rank's chunk in fp32 until the optimizer takes it
    tied: bool = False  # holds only the embedding tied across pipeline stages
    reductions: int = 0  # reductions issued this step (must end at exactly 1)


HISTORY = 64  # steps of per-step counters kept (bounded: a long run must not grow them)


def _history() -> deque:
    return deque(maxlen=HISTORY)


@dataclass
class ReductionStats:
    """What the buckets did, for tests and for the curious: each step appends one entry to the histories."""

    steps: int = 0
    per_step: deque = field(default_factory=_history)  # reductions of each bucket per finished step (all 1)
    in_backward: deque = field(default_factory=_history)  # buckets issued while backward still ran
    in_finish: deque = field(default_factory=_history)  # buckets issued by finish() (no overlap)
    unarmed_hooks: int = 0  # gradients that arrived outside the armed (last) micro-batch
    issued_unarmed: int = 0  # reductions issued before the last micro-batch: 0 by construction

    def as_dict(self) -> dict:
        return {k: list(v) if isinstance(v, deque) else v for k, v in self.__dict__.items()}


@dataclass(eq=False)
class Segment:
    """The elements [start, start + length) of one parameter (flattened, tp-local) that this rank owns."""

    owner: int  # index into `named_params`
    start: int
    data: torch.Tensor  # view of the parameter's storage (fp32: these are the master weights)
    grad: torch.Tensor | None  # view of the reduced gradient
    master_init: torch.Tensor | None = None  # bf16 parameters: the segment's fp32 values at the build


class GradView:
    """Stands in for a parameter where `sync_tp_grads` / `global_grad_norm` read one: a gradient view plus the
    parameter's tensor-parallel marks."""

    def __init__(self, grad: torch.Tensor, p: nn.Parameter) -> None:
        self.grad = grad
        copy_layout(p, self)


class GradViews:
    """A duck-typed module whose `parameters()` are gradient views, so that the tensor-parallel gradient code
    (which reads ``p.grad`` and the marks) runs unchanged on shards of gradients."""

    def __init__(self, views: list[GradView]) -> None:
        self.views = views

    def parameters(self) -> Iterator[GradView]:
        return iter(self.views)


class DataParallelGrads:
    """Bucketed, overlapped gradient reduction over ``mesh.dp_cp_group``; the ``grads`` object of TrainStep.

    Per step: backward of every micro-batch (call `start_last_microbatch()` before the last one), then
    `finish()`, then `clip(max_norm)`, then the optimizer. zero=0 works with any optimizer over
    ``model.parameters()``; zero=1/2 with megaloom.optim.zero.ShardedOptimizer.
    """

    def __init__(self, model: nn.Module, mesh: Mesh, zero: int = 0, bucket_mb: float = DEFAULT_BUCKET_MB,
                 tied: nn.Parameter | None = None, tied_group: comm.Group = None,
                 param_gather_dtype: torch.dtype = torch.float32, pad_multiple: int = 1,
                 low_precision_params: bool = False) -> None:
        """``tied``/``tied_group``: with pp > 1, this stage's copy of the embedding tied to the head and the
        {first, last stage} group its gradient is summed over (pipeline.stage.tied_parameter and
        build_embedding_groups). ``param_gather_dtype``: what the zero>=1 parameter all-gathers move.
        ``pad_multiple``: each bucket is padded to a multiple of its group's size times this.
        ``low_precision_params`` (train.bf16_params, ``param_gather_dtype`` below fp32): the parameters themselves
        are held in ``param_gather_dtype`` (zero 1/2: the gather lands in them; the matmuls read them without a
        cast), their fp32 values live only in the optimizer's masters (`Segment.master_init` hands it the build's
        values): this rank's shard with zero 1/2, all of them with zero 0 (the "shard" is then every bucket whole:
        the reduction is an all-reduce and nothing is gathered; Megatron's non-distributed optimizer)."""
        if zero not in (0, 1, 2):
            raise ConfigError(f"parallel.zero={zero}: DataParallelGrads handles 0, 1 and 2; stage 3 is "
                              "megaloom.optim.zero.FullyShardedGrads (use zero.build_data_parallel).")
        if not bucket_mb > 0:
            raise ConfigError(f"parallel.bucket_mb={bucket_mb} must be > 0 (MB of fp32 gradients per bucket); "
                              f"e.g. parallel.bucket_mb={DEFAULT_BUCKET_MB:g}.")
        if tied is not None and tied_group is None:
            raise ValueError("an embedding tied across pipeline stages needs its group (build_embedding_groups)")
        if param_gather_dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ConfigError(f"parameter all-gathers in {param_gather_dtype} are not supported; use float32, "
                              "bfloat16 or float16.")
        self.model, self.mesh, self.zero = model, mesh, zero
        self.tied, self.tied_group = tied, tied_group
        self.gather_dtype = param_gather_dtype if zero else torch.float32
        if low_precision_params and param_gather_dtype == torch.float32:
            raise ConfigError("train.bf16_params=true holds the trained weights in bf16: it needs parallel."
                              "param_gather=auto with train.precision bf16 or fp8; set train.bf16_params=false.")
        self.param_dtype = param_gather_dtype if low_precision_params else torch.float32
        # The optimizer steps fp32 masters of a shard: ZeRO's chunk of every bucket, or every bucket whole (zero 0
        # with bf16 parameters). Plain zero 0 leaves the parameters to any optimizer over model.parameters().
        self.owns_shard = bool(zero) or low_precision_params
        self.group = mesh.dp_cp_group
        self.size, self.rank = comm.group_size(self.group), comm.group_rank(self.group)
        names = {p: n for n, p in model.named_parameters()}
        self.params = [p for p in model.parameters() if p.requires_grad]  # a tied weight once
        self.named_params = [(names[p], p) for p in self.params]
        for name, p in self.named_params:
            if p.dtype != torch.float32:  # built in fp32; bf16 parameters are made here (_move_params)
                raise ValueError(f"data parallelism keeps fp32 main gradients; parameter {name} is {p.dtype}")
        self.bucket_numel = max(1, int(bucket_mb * 2**20) // 4)
        self._lay_out_buckets(tied, pad_multiple)
        self.stats = ReductionStats()
        self._armed = False
        self._next = 0  # the next bucket to issue, in order
        self._ready: set[int] = set()  # ids of parameters whose gradient arrived in the armed backward
        self._armed_ids: set[int] | None = None  # armed parameters (None: all) when chunks are armed one by one
        self._needs_zero = False
        self.fused = False  # set by enable_fusion: weight gradients added into the buckets by their GEMMs
        # Set by a 1-bit optimizer (optim/onebit.py): True while steps keep their gradients local (no reduction).
        self.local_steps: Callable[[], bool] | None = None
        self._shard_views = GradViews([GradView(s.grad, self.params[s.owner]) for s in self.shard_segments()]) \
            if self.owns_shard else None
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]
        self.constants = DeviceConstants()  # the norm's per-shard weights, on the device once

    def _lay_out_buckets(self, tied: nn.Parameter | None, pad_multiple: int) -> None:
        """The buckets (each its group's, padded), their main-gradient storage and, where the optimizer owns a
        shard, the parameters moved into one flat buffer per bucket."""
        mesh, zero = self.mesh, self.zero
        device = self.params[0].device if self.params else mesh.device
        # Expert weights (ep > 1) are reduced over the edp group only: the dp ranks that hold the same experts.
        # The tied embedding gets a bucket of its own: then it is laid out alike on the first and last stage.
        kinds = ["tied" if p is tied else "expert" if is_expert_param(p) and mesh.ep > 1 else "dense"
                 for p in self.params]
        dense = (self.group, self.size, self.rank)
        groups = {"dense": dense, "tied": dense,
                  "expert": (mesh.edp_group, comm.group_size(mesh.edp_group), comm.group_rank(mesh.edp_group))}
        plan = plan_grouped_buckets([p.numel() for p in self.params], kinds, self.bucket_numel,
                                    {k: g[1] * pad_multiple for k, g in groups.items()})
        self.buckets: list[Bucket] = []
        shard_offset = 0
        for i, (idx, offs, padded, kind) in enumerate(plan):
            group, size, rank = groups[kind]
            self.buckets.append(Bucket(i, [self.params[j] for j in idx], offs, padded, shard_offset, group, size,
                                       rank, tied=kind == "tied"))
            shard_offset += padded // size
        self._where = {p: (b, off) for b in self.buckets for p, off in zip(b.params, b.offsets, strict=True)}
        # zero=1: the reduced chunks stay in the buckets; zero=2 frees the buckets, so the chunks need a home.
        self.grad_shard = torch.zeros(shard_offset, dtype=torch.float32, device=device) if zero == 2 else None
        for b in self.buckets:
            if zero < 2:
                self._allocate(b)
            if self.owns_shard:
                self._move_params(b)

    def enable_fusion(self, model: nn.Module, embeddings: bool = True) -> int:
        """train.grad_accum_fusion: the blocks' linears add their weight gradients into ``main_grad`` themselves
        (megaloom/parallel/grad_fusion.py), and with ``embeddings`` (train.embedding_grad_fusion) the untied token
        embedding; returns how many weights. zero 0/1 only (zero 2 frees the buckets)."""
        if self.zero not in (0, 1):
            raise ConfigError(f"train.grad_accum_fusion=true needs gradient buckets that live across steps "
                              f"(parallel.zero 0 or 1); got zero={self.zero}.")
        fused = enable_grad_accum_fusion(model, self.tied, embeddings)
        self.fused = bool(fused)
        return len(fused)

    # ------------------------------------------------------------------------------------------- layout

    def _allocate(self, b: Bucket) -> None:
        b.data = torch.zeros(b.padded, dtype=torch.float32, device=self.grad_device)
        for p, off in zip(b.params, b.offsets, strict=True):
            p.main_grad = b.data[off:off + p.numel()].view_as(p)

    @property
    def grad_device(self) -> torch.device:
        return self.params[0].device if self.params else self.mesh.device

    def _move_params(self, b: Bucket) -> None:
        """Parameters become views of one flat buffer per bucket: the target of the in-place all-gather. With
        low-precision parameters the buffer is in ``param_dtype`` and this rank's chunk of the fp32 values is kept
        for the optimizer's masters (`master_init`, released once they exist)."""
        flat = torch.zeros(b.padded, dtype=torch.float32, device=self.grad_device)
        with torch.no_grad():
            for p, off in zip(b.params, b.offsets, strict=True):
                flat[off:off + p.numel()].view_as(p).copy_(p)
            if self.param_dtype != torch.float32:
                lo, hi = self._chunk(b)
                b.master_init = flat[lo:hi].clone()
                flat = flat.to(self.param_dtype)
            b.param_data = flat
            for p, off in zip(b.params, b.offsets, strict=True):
                p.data = b.param_data[off:off + p.numel()].view(p.shape)

    def release_master_init(self) -> None:
        """The optimizer has its fp32 masters: drop the build's copies."""
        for b in self.buckets:
            b.master_init = None

    def _chunk(self, b: Bucket) -> tuple[int, int]:
        if not self.zero:  # bf16 parameters at zero 0: every bucket whole
            return 0, b.padded
        n = b.padded // b.size
        return b.rank * n, (b.rank + 1) * n

    def _grad_chunk(self, b: Bucket) -> torch.Tensor:
        """This rank's reduced chunk of bucket ``b``: a view of the bucket itself (zero 1) or of ``grad_shard``."""
        if self.grad_shard is None:
            lo, hi = self._chunk(b)
            return b.data[lo:hi]
        return self.grad_shard[b.shard_offset:b.shard_offset + b.padded // b.size]

    def shard_segments(self) -> list[Segment]:
        """zero>=1: the pieces of parameters whose optimizer state this rank owns (its chunk of each bucket); zero 0
        with bf16 parameters: every parameter whole."""
        if not self.owns_shard:
            raise RuntimeError("shard_segments: only ZeRO (zero >= 1) or bf16 parameters give the optimizer a shard")
        owner = {p: i for i, p in enumerate(self.params)}
        segs: list[Segment] = []
        for b in self.buckets:
            lo, hi = self._chunk(b)
            for p, off in zip(b.params, b.offsets, strict=True):
                a, e = max(lo, off), min(hi, off + p.numel())
                if e > a:
                    init = b.master_init[a - lo:e - lo] if b.master_init is not None else None
                    segs.append(Segment(owner[p], a - off, b.param_data[a:e], self._grad_chunk(b)[a - lo:e - lo],
                                        init))
        return segs

    def shard_numel(self) -> int:
        """Elements of this rank's reduced chunks (zero >= 1), padding included."""
        return sum(b.padded // b.size for b in self.buckets) if self.zero else 0

    # --------------------------------------------------------------------------------------------- backward

    def _on_grad(self, p: nn.Parameter) -> None:
        b, _ = self._where[p]
        if self._needs_zero:  # the first gradient of a new step: clear what the last step accumulated
            if self.fused:
                raise RuntimeError("train.grad_accum_fusion: the weight gradients were added into the buckets "
                                   "before they were cleared; call DataParallelGrads.prepare_step() before the "
                                   "first backward of every step (TrainStep does)")
            self.zero_grad()
        if b.data is None:
            self._allocate(b)
        if p.grad is None:
            return
        if p.grad.data_ptr() == p.main_grad.data_ptr():
            raise RuntimeError("a new backward started while p.grad still aliases p.main_grad: call "
                               "optimizer.zero_grad(set_to_none=True) after every step")
        if not getattr(p, "fused_wgrad", False):  # fused: already in main_grad, p.grad is a stand-in
            p.main_grad.add_(p.grad)
        p.grad = None
        if not self._armed or (self._armed_ids is not None and id(p) not in self._armed_ids):
            self.stats.unarmed_hooks += 1
            return
        if b.work is not None:
            raise RuntimeError(f"the gradient of {self._name(p)} arrived after its bucket's reduction was issued "
                               "(a parameter used again after backward passed it, e.g. reentrant recompute?)")
        if id(p) in self._ready:  # a second accumulation in the same backward, still before the launch
            return
        self._ready.add(id(p))
        b.pending -= 1
        while self._next < len(self.buckets) and self.buckets[self._next].pending == 0:
            self._issue(self.buckets[self._next], in_backward=True)
            self._next += 1

    def _name(self, p: nn.Parameter) -> str:
        return next(n for n, q in self.named_params if q is p)

    @property
    def local(self) -> bool:
        """Whether this step's gradients stay local (1-bit optimizers after their warm-up): no bucket reduction."""
        return self.local_steps is not None and self.local_steps()

    def _issue(self, b: Bucket, in_backward: bool) -> None:
        if not self._armed:
            self.stats.issued_unarmed += 1
        if self.local:  # the bucket is complete; the optimizer exchanges its compressed momentum instead
            b.work = comm.Pending()
            b.reductions += 1
            (self.stats.in_backward if in_backward else self.stats.in_finish)[-1] += 1
            return
        # Average over the data-parallel size (pre-divided, as Megatron does: no overflow in sums). Expert buckets
        # too: summed over edp, their gradients already hold every ep peer's tokens (the all-to-all backward).
        b.data.div_(self.size)
        if self.zero == 0:
            b.work = comm.all_reduce_async(b.data, b.group, recorder=self.mesh.recorder)
        else:
            # The bucket is not read after its reduction except for this rank's chunk: the op may reduce in it.
            b.work = comm.reduce_scatter_async(self._grad_chunk(b), b.data, b.group, recorder=self.mesh.recorder,
                                               scratch=True)
        b.reductions += 1
        (self.stats.in_backward if in_backward else self.stats.in_finish)[-1] += 1

    def prepare_step(self) -> None:
        """Before the first forward of a step: clear what the last step accumulated (otherwise done by the first
        gradient of the step; weight gradients fused into the buckets (grad_fusion) arrive before any hook)."""
        if self._needs_zero:
            self.zero_grad()

    def zero_grad(self) -> None:
        """Clear the main gradients (done automatically by the first gradient of the next step)."""
        for b in self.buckets:
            if b.data is not None:
                b.data.zero_()
        self._needs_zero = False

    def start_last_microbatch(self, params: list[nn.Parameter] | None = None) -> None:
        """Call before the backward of the step's last micro-batch: its buckets are reduced as they fill.
        ``params``: arm only these (a pipeline chunk whose last backward comes next); later calls in the same
        step add more. Gradients of parameters not armed yet only accumulate."""
        if params is not None and self._armed:
            if self._armed_ids is not None:
                self._armed_ids.update(id(p) for p in params)
            return
        self._armed = True
        self._armed_ids = None if params is None else {id(p) for p in params}
        self._next = 0
        self._ready.clear()
        for b in self.buckets:
            b.pending, b.work, b.reductions = len(b.params), None, 0
        self.stats.in_backward.append(0)
        self.stats.in_finish.append(0)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """For symmetry with DDP: backward inside only accumulates (which is what happens unless armed)."""
        armed, self._armed = self._armed, False
        try:
            yield
        finally:
            self._armed = armed

    def finish(self) -> None:
        """Issue the buckets not yet issued (in order), wait for all, and complete the tensor-parallel part."""
        if not self._armed:
            self.start_last_microbatch()
        if self._needs_zero:  # a step without any backward: reduce zeros rather than last step's gradients
            self.zero_grad()
        for b in self.buckets[self._next:]:
            if b.data is None:
                self._allocate(b)
            self._issue(b, in_backward=False)
        self._next = len(self.buckets)
        for b in self.buckets:
            b.work.wait()
            b.work = None
            if b.tied:  # the other stage's copy: sum the reduced gradient (or this rank's chunk of it)
                comm.all_reduce(b.data if self.zero == 0 else self._grad_chunk(b), self.tied_group,
                                recorder=self.mesh.recorder)
        self.stats.per_step.append([b.reductions for b in self.buckets])
        self.stats.steps += 1
        self._armed, self._needs_zero, self._armed_ids = False, True, None
        if not self.owns_shard:
            for p in self.params:
                p.grad = p.main_grad
            if self.mesh.tp > 1:
                sync_tp_grads(self.model, self.mesh)
        else:
            if self.mesh.tp > 1:
                sync_tp_grads(self._shard_views, self.mesh)
            if self.zero == 2:  # keep only the shard: the full buckets come back at the next step's backward
                for b in self.buckets:
                    b.data = None
                for p in self.params:
                    p.main_grad = None

    # ------------------------------------------------------------------------------------ after reduction

    def local_grads(self) -> list[torch.Tensor]:
        """The reduced gradients this rank holds (for the fp16 overflow check and unscaling)."""
        if self.owns_shard:
            return [self.grad_shard] if self.grad_shard is not None else [self._grad_chunk(b) for b in self.buckets]
        return [p.grad for p in self.params if p.grad is not None]

    def clip(self, max_norm: float) -> torch.Tensor:
        """Global L2 norm of the full gradient (each element counted once); scales gradients in place when it
        exceeds ``max_norm``. Returns the norm before clipping."""
        if not self.owns_shard:
            if self.mesh.tp == 1 and self.mesh.pp == 1 and self.mesh.ep == 1:
                if not self.local:
                    return torch.nn.utils.clip_grad_norm_(self.params, max_norm, foreach=True)
                total = torch.nn.utils.get_total_norm([p.grad for p in self.params if p.grad is not None],
                                                      foreach=True)
            else:  # the tied head copy of a pipeline's last stage counts once (grad_norm.py)
                total = global_grad_norm(self.params, self.mesh, constants=self.constants)
            if self.local:  # each rank's own gradient: the root-mean-square of their norms, the same on every rank
                sq = total.float().pow(2).reshape(1)
                comm.all_reduce(sq, self.group, recorder=self.mesh.recorder)
                total = (sq / self.size).sqrt().reshape(())
        else:
            total = global_grad_norm(self._shard_views.views, self.mesh, over_dp=bool(self.zero),
                                     constants=self.constants)
        local = self.local_grads()
        if math.isfinite(max_norm) and local:  # a pipeline stage may hold only frozen parameters (model.freeze)
            coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            torch._foreach_mul_(local, coef)
        return total

    # ------------------------------------------------------------------------------ parameters (zero >= 1)

    def segment_grads(self, segs: list[Segment]) -> list[torch.Tensor]:
        """The reduced gradient of each segment: fixed views of the buckets (zero 1) or of ``grad_shard``."""
        return [s.grad for s in segs]

    def publish_params(self, overlap: bool) -> None:
        """After the optimizer updated this rank's chunk: share it with every replica (``overlap``: return at
        once; each module's forward pre-hook waits for its buckets)."""
        self.gather_params()
        if not overlap:
            self.wait_params()

    def gather_params(self) -> None:
        """Issue the in-place all-gather of every bucket's parameters (after the optimizer updated this rank's
        chunk), last bucket first: it holds the first layers, which the next forward needs first. In
        ``gather_dtype`` below fp32 the chunk is rounded into a landing buffer of that dtype, which is gathered
        and copied into the parameters when waited for (this rank's chunk too, so all replicas agree). Zero 0 (bf16
        parameters): every rank wrote every parameter from its own (equal) masters; nothing to gather."""
        if not self.zero:
            return
        for b in reversed(self.buckets):
            self.gather_bucket(b)

    def gather_bucket(self, b: Bucket) -> None:
        """Issue bucket ``b``'s in-place parameter all-gather (`gather_params`' step; an offloaded step issues
        each bucket's as soon as its chunk is back on the device)."""
        lo, hi = self._chunk(b)
        # Nothing reads a bucket's parameters before its gather is waited for (module pre-hooks, the state-dict
        # pre-hook, the optimizer step): the other ranks' chunks may be overwritten in any way meanwhile.
        if b.param_data.dtype == self.gather_dtype:  # fp32, or parameters held in the gather's dtype
            b.gather = comm.all_gather_into_async(b.param_data, b.param_data[lo:hi], b.group,
                                                  recorder=self.mesh.recorder, scratch=True)
            return
        b.gather_buf = torch.empty(b.padded, dtype=self.gather_dtype, device=b.param_data.device)
        b.gather_buf[lo:hi].copy_(b.param_data[lo:hi])
        b.gather = comm.all_gather_into_async(b.gather_buf, b.gather_buf[lo:hi], b.group,
                                              recorder=self.mesh.recorder, scratch=True)

    def wait_params(self, params: list[nn.Parameter] | None = None) -> None:
        """Block until the all-gathers holding ``params`` (default: all) have landed."""
        buckets = self.buckets if params is None else {self._where[p][0] for p in params if p in self._where}
        for b in buckets:
            if b.gather is not None:
                b.gather.wait()
                b.gather = None
                if b.gather_buf is not None:
                    b.param_data.copy_(b.gather_buf)
                    b.gather_buf = None

    def params_in_flight(self) -> bool:
        return any(b.gather is not None for b in self.buckets)

    def memory(self) -> dict[str, int]:
        """Bytes this rank holds now: full main-grad buckets, the gradient shard (zero 2; zero 1's is inside the
        buckets)."""
        return {"main_grads": sum(b.data.numel() * 4 for b in self.buckets if b.data is not None),
                "grad_shard": 0 if self.grad_shard is None else self.grad_shard.numel() * 4}

    def remove(self) -> None:
        """Detach the hooks (the buffers stay where they are)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []


# ------------------------------------------------------------------ fused weight gradients (grad_fusion.py)
# Here, not in grad_fusion.py: the tensor-parallel linears run their matmul through grad_fusion.fused_linear, so the
# pass that finds them in a model sits above them (both in grad_fusion.py was an import circle, issue 37).


def fusable_linears(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The blocks' attention and dense-MLP linears whose weight gradient can be fused: plain or tensor-parallel
    linears with a trainable fp32 weight (or bf16: train.bf16_params, fp32 main gradients in the buckets), not in
    float8, outside Mixture-of-Experts layers."""
    layers = getattr(model, "layers", None)
    if layers is None:
        return []
    out = []
    for bname, block in layers.items():
        moe = [name for name, m in block.named_modules() if isinstance(m, MoE)]
        for name, m in block.named_modules():
            if any(name == x or name.startswith(x + ".") for x in moe):
                continue
            if isinstance(m, ColumnParallelLinear | RowParallelLinear):
                if m.fp8_recipe is not None:
                    continue
            elif type(m) is not nn.Linear:
                continue
            w = m.weight
            if w.requires_grad and w.dtype in (torch.float32, torch.bfloat16):
                out.append((f"layers.{bname}.{name}", m))
    return out


def fusable_embeddings(model: nn.Module, tied: nn.Parameter | None = None) -> list[tuple[str, nn.Module]]:
    """The token embedding (``model.tok_emb``, plain or vocabulary-parallel) when its weight gradient can be fused
    (grad_fusion.FusedEmbeddingGrad): a trainable fp32 or bf16 weight held by it alone (not ``tied``, not shared
    with a head), without ``padding_idx``, ``max_norm`` or sparse gradients. Only that module: an embedding whose
    weight a model reads directly (a ViT's positions: ``x + pos_emb.weight``) would lose its gradient."""
    m = getattr(model, "tok_emb", None)
    if isinstance(m, VocabParallelEmbedding):
        pass
    elif type(m) is not nn.Embedding or m.padding_idx is not None or m.max_norm is not None or m.sparse:
        return []
    w = m.weight
    shared = sum(p is w for _, p in model.named_parameters(remove_duplicate=False)) > 1
    if w.requires_grad and w.dtype in (torch.float32, torch.bfloat16) and w is not tied and not shared:
        return [("tok_emb", m)]
    return []


def enable_grad_accum_fusion(model: nn.Module, tied: nn.Parameter | None = None,
                             embeddings: bool = True) -> list[nn.Parameter]:
    """Route the weight gradients of `fusable_linears` (and with ``embeddings`` of `fusable_embeddings`) into their
    ``main_grad`` (which the data-parallel buckets have given them); returns the parameters concerned. Call after
    the buckets are built, before compile."""
    fused = []
    for name, m in fusable_embeddings(model, tied) if embeddings else []:
        if getattr(m.weight, "main_grad", None) is None:
            continue  # (a parameter outside the buckets: nothing to add into)
        if type(m) is nn.Embedding:
            setattr(model, name, FusedEmbedding.from_embedding(m))
        m.weight.fused_wgrad = True
        fused.append(m.weight)
    for name, m in fusable_linears(model):
        if getattr(m.weight, "main_grad", None) is None:
            raise RuntimeError(f"train.grad_accum_fusion: {name}.weight has no main_grad (data-parallel buckets "
                               "with parallel.zero 0 or 1 give every parameter one)")
        if isinstance(m, ColumnParallelLinear | RowParallelLinear):
            m.fused_wgrad = True
        else:
            parent_name, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent_name), leaf, FusedLinear.from_linear(m))
        m.weight.fused_wgrad = True
        fused.append(m.weight)
    return fused
