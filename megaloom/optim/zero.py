"""ZeRO: the optimizer state (1), the gradients (2) and the parameters (3) split over data-parallel ranks.

Stages 1 and 2 (Rajbhandari et al. 2020; Megatron's distributed optimizer) build on DataParallelGrads'
bucket layout: each rank owns a 1/dp chunk of every bucket (buckets are padded so the chunks are equal),
which together form its shard. `ShardedOptimizer` keeps AdamW or LAMB state for those elements only, steps
them from the reduce-scattered ``grad_shard`` and then all-gathers every bucket's parameters in place
(asynchronously; a forward pre-hook on each module waits for the buckets holding its parameters, so the
gather overlaps the start of the next forward). megaloom keeps fp32 parameters and computes under
autocast, so the parameters are the fp32 master weights: the shard's master weights are views of them
and no second copy exists. Except when the all-gathers move bf16 (`parallel.data_parallel.param_gather_dtype`, the
default when training in bf16: half the bytes): then every replica holds bf16-rounded weights and the optimizer
keeps its shard's fp32 master weights apart (1/dp of the model in fp32), writes them into the parameters after each
step and checkpoints them in place of the rounded parameters, so a resumed run continues exactly.

The shard is cut into per-parameter segments so that weight decay skips 1-D parameters (one parameter
group each) and LAMB can compute one trust ratio per parameter: each segment's partial squared norms are
summed over the data-parallel group (the pieces of a parameter) and over tp (its tensor-parallel pieces).

Stage 3 is PyTorch's FSDP2 (`fully_shard`) on each transformer block and on the root: parameters sharded on
dim 0 over the data-parallel group, gathered just in time for forward and backward, freed after. In bf16 its
`MixedPrecisionPolicy` gathers bf16 parameters and reduce-scatters fp32 gradients (as TorchTitan does). Chosen
because it is the maintained implementation of exactly this (prefetching, reduce-scatter in post-backward,
memory reuse) and it composes with our tensor-parallel layers: those hold plain local tensors, which FSDP2
treats as the parameters to shard over dp only, and their tp marks are copied to the sharded parameters.
The optimizer is the same `ShardedOptimizer`, over the local DTensor shards.

Checkpoints stay layout-free without gathering anything: every rank saves its own pieces as DCP shards under the
parameters' full shapes (checkpoint/sharded.py). The tests' gather-everything references (full tensors under
parameter names) are tests/parallel/full_state.py's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import partial
from typing import Protocol

import torch
from torch import nn

from megaloom import accelerator
from megaloom.config import ConfigError
from megaloom.optim.lamb import Lamb
from megaloom.parallel import comm
from megaloom.parallel.data_parallel import (
    DEFAULT_BUCKET_MB,
    STEP_GROUP_ELEMENTS,
    DataParallelGrads,
    GradView,
    GradViews,
    ReductionStats,
    Segment,
)
from megaloom.parallel.expert import is_expert_param
from megaloom.parallel.grad_norm import DeviceConstants, copy_weight, global_grad_norm
from megaloom.parallel.layout import copy_layout
from megaloom.parallel.mesh import Mesh
from megaloom.parallel.tensor import sync_tp_grads

OPTIMIZERS = ("adamw", "lamb")


class ShardLayout(Protocol):
    """What ShardedOptimizer needs from the gradient side (DataParallelGrads with zero 1/2, or
    FullyShardedGrads)."""

    mesh: Mesh
    named_params: list[tuple[str, nn.Parameter]]

    group: comm.Group

    def shard_segments(self) -> list[Segment]: ...

    def segment_grads(self, segs: list[Segment]) -> list[torch.Tensor]: ...

    def publish_params(self, overlap: bool) -> None: ...

    def wait_params(self, params: list[nn.Parameter] | None = None) -> None: ...


# ------------------------------------------------------------------------------------------ ZeRO-3: FSDP2


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (a view of its storage), or ``t`` itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def _dim0_start(rows: int, world: int, rank: int) -> int:
    """First row of ``rank``'s shard under FSDP2's dim-0 split (torch.chunk: ceil(rows / world) each)."""
    return min(rank * math.ceil(rows / world), rows)


class FullyShardedGrads:
    """ZeRO-3 by FSDP2: the ``grads`` object of TrainStep when parallel.zero=3 (same methods as
    DataParallelGrads). FSDP2 reduce-scatters in its own post-backward hooks; gradient sync is switched off
    for all micro-batches but the last, so nothing is reduced earlier."""

    def __init__(self, model: nn.Module, mesh: Mesh, param_dtype: torch.dtype = torch.float32) -> None:
        """``param_dtype``: the dtype FSDP2 all-gathers and computes the parameters in (bf16 when training in
        bf16); gradients are reduce-scattered in fp32 and the sharded master weights stay fp32."""
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        self.group = mesh.dp_cp_group
        self.size, self.rank = comm.group_size(self.group), comm.group_rank(self.group)
        if self.size == 1:
            raise ConfigError("parallel.zero=3 shards parameters over data-parallel ranks, but there is only one "
                              "(world size / (tp*pp*cp) = 1); set parallel.zero=0 or add ranks.")
        self.model, self.mesh, self.zero = model, mesh, 3
        layouts = dict(model.named_parameters())
        self.device_mesh = DeviceMesh.from_group(self.group, mesh.device.type)
        self.param_dtype = param_dtype
        policy = MixedPrecisionPolicy() if param_dtype == torch.float32 else \
            MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
        # Expert weights (ep > 1) exist only on the edp ranks that share an ep rank: they are sharded over edp,
        # by their own FSDP2 unit inside the block (as TorchTitan shards experts over dp mod ep). Their local
        # gradient already sums the tokens of the whole ep group, so its reduction over edp divides by the full
        # data-parallel size like every dense gradient's (not by edp, FSDP2's default).
        expert_units = [m for m in model.modules() if m is not model and
                        any(is_expert_param(p) for p in m.parameters(recurse=False))] if mesh.ep > 1 else []
        self.expert_size = self.expert_rank = None
        if expert_units:
            edp_mesh = DeviceMesh.from_group(mesh.edp_group, mesh.device.type)
            self.expert_size, self.expert_rank = comm.group_size(mesh.edp_group), comm.group_rank(mesh.edp_group)
            for unit in expert_units:
                if any(not is_expert_param(p) for p in unit.parameters()):
                    raise ValueError(f"zero=3 with ep: {type(unit).__name__} mixes expert and dense parameters")
                fully_shard(unit, mesh=edp_mesh, mp_policy=policy)
                # FSDP2 averages over edp; the hook (run on its reduced shard, also when edp is 1) divides by the
                # rest, dp x cp / edp = ep. Not set_gradient_divide_factor: a pre-scaled sum, which gloo lacks,
                # and with one rank some torch versions divide by it twice.
                unit.set_all_reduce_hook(partial(torch.Tensor.div_, other=float(mesh.ep)))
        for block in getattr(model, "layers", {}).values():
            fully_shard(block, mesh=self.device_mesh, mp_policy=policy)
        fully_shard(model, mesh=self.device_mesh, mp_policy=policy)
        # The sharded parameters are new objects: carry the layouts over, the frozen ones' too (a LoRA base, a
        # frozen vision tower): their tp boxes place their initialisation and their checkpoint slices.
        for n, p in model.named_parameters():
            copy_layout(layouts[n], p)
        self.named_params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.params = [p for _, p in self.named_params]
        model.set_requires_gradient_sync(False)
        self.stats = ReductionStats()
        self._armed = False
        self.constants = DeviceConstants()  # the norm's per-parameter weights, on the device once

    def _shard_of(self, p: torch.Tensor) -> tuple[int, int]:
        """(ranks, index) of the group a parameter is sharded over: edp for expert weights, else dp x cp."""
        if self.expert_size is not None and is_expert_param(p):
            return self.expert_size, self.expert_rank
        return self.size, self.rank

    def shard_segments(self) -> list[Segment]:
        segs = []
        for i, p in enumerate(self.params):
            local = _local(p.detach())
            row = math.prod(p.shape[1:])
            start = _dim0_start(p.shape[0], *self._shard_of(p)) * row
            if local.numel():
                segs.append(Segment(i, start, local, None))
        return segs

    def segment_grads(self, segs: list[Segment]) -> list[torch.Tensor]:
        """The current local gradient of each segment (FSDP2 assigns new gradient tensors every step)."""
        out = []
        for s in segs:
            g = self.params[s.owner].grad
            out.append(torch.zeros_like(s.data) if g is None else _local(g))
        return out

    def _views(self) -> GradViews:
        return GradViews([GradView(_local(p.grad), p) for p in self.params
                          if p.grad is not None and _local(p.grad).numel()])

    def start_last_microbatch(self, params: list[nn.Parameter] | None = None) -> None:
        self._armed = True
        self.model.set_requires_gradient_sync(True)

    def finish(self) -> None:
        """FSDP2 has reduce-scattered the last backward (it waits for that before backward returns); complete
        the tensor-parallel part on the local shards."""
        if not self._armed:
            raise RuntimeError("zero=3: call start_last_microbatch() before the last backward (FSDP2 reduces "
                               "gradients during it); without that nothing was reduced this step")
        self._armed = False
        self.model.set_requires_gradient_sync(False)
        self.stats.steps += 1
        if self.mesh.tp > 1:
            sync_tp_grads(self._views(), self.mesh)

    def local_grads(self) -> list[torch.Tensor]:
        return [v.grad for v in self._views().views]

    def clip(self, max_norm: float) -> torch.Tensor:
        views = self._views()
        total = global_grad_norm(views.views, self.mesh, over_dp=True, constants=self.constants)
        if math.isfinite(max_norm):
            coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            torch._foreach_mul_([v.grad for v in views.views], coef)
        return total

    def wait_params(self, params: list[nn.Parameter] | None = None) -> None:
        """FSDP2 gathers parameters itself, just in time."""

    def publish_params(self, overlap: bool) -> None:
        """Nothing to do: the next forward all-gathers the updated shards."""

    def memory(self) -> dict[str, int]:
        return {"params": sum(_local(p.detach()).numel() * p.element_size() for p in self.params)}


# ------------------------------------------------------------------------------------------- the optimizer


class _WaitForParams:
    """Forward pre-hook: block until the all-gathers holding these parameters have landed."""

    def __init__(self, layout: ShardLayout, params: list[nn.Parameter]) -> None:
        self.layout, self.params = layout, params

    # On a compiled block (`Module.compile` compiles the hooks with the forward) the wait runs eagerly, before the
    # block's graph: a work handle's wait cannot be traced, and it must happen before the graph reads weights.
    @torch.compiler.disable
    def __call__(self, module: nn.Module, args: tuple) -> None:
        self.layout.wait_params(self.params)


def register_param_waits(layout: ShardLayout, whole_modules: Sequence[nn.Module] = ()) -> list:
    """ZeRO-1/2's forward pre-hooks: each module waits for the parameter all-gathers holding its own parameters
    (``whole_modules``: one hook for all theirs, none inside), and a state-dict pre-hook waits for all (reading or
    loading the weights must not race with a gather in flight). None for FSDP2, which gathers itself."""
    if not isinstance(layout, DataParallelGrads):
        return []
    hooks = []
    model = layout.model
    whole = {id(m) for m in whole_modules}
    inside = {id(sub) for m in whole_modules for sub in m.modules() if sub is not m}
    for m in model.modules():
        if id(m) in inside:
            continue
        own = [p for p in m.parameters(recurse=id(m) in whole) if p.requires_grad]
        if own:
            hooks.append(m.register_forward_pre_hook(_WaitForParams(layout, own)))
    hooks.append(model.register_state_dict_pre_hook(lambda *_: layout.wait_params()))
    return hooks


def shard_norm_sync(owners: list[int], params: list[nn.Parameter], mesh: Mesh, group: comm.Group,
                    constants: DeviceConstants | None = None):
    """LAMB's ``norm_sync`` for ZeRO shards: segment partial squares summed per parameter, over the data-
    parallel group (the other pieces of each parameter), then weighted and summed over tp. The index and the
    weights go to the device once (``constants``), not every step."""
    constants = constants if constants is not None else DeviceConstants()
    weights = [copy_weight(p, mesh, over_dp=True) for p in params]

    def sync(partial: torch.Tensor) -> torch.Tensor:
        index = constants.get("owners", partial.device, lambda: torch.tensor(owners, dtype=torch.long))
        w = constants.get("weights", partial.device, lambda: torch.tensor(weights, dtype=torch.float32)[:, None])
        per = partial.new_zeros(len(params), 2)
        per.index_add_(0, index, partial)
        comm.all_reduce(per, group, recorder=mesh.recorder)
        per *= w
        comm.all_reduce(per, mesh.tp_group, recorder=mesh.recorder)
        return per[index]

    sync.constants = constants
    return sync


def step_groups(indices: list[int], numels: list[int], limit: int) -> list[list[int]]:
    """``indices`` cut, in order, into runs that stop once they hold ``limit`` elements or more: each run is
    under ``limit`` plus its last tensor's elements."""
    runs: list[list[int]] = [[]]
    held = 0
    for i, n in zip(indices, numels, strict=True):
        if held >= limit:
            runs.append([])
            held = 0
        runs[-1].append(i)
        held += n
    return [r for r in runs if r]


class ShardedOptimizer:
    """AdamW or LAMB over this rank's shard (ZeRO 1, 2 and 3). Behaves like a torch optimizer where the
    training loop touches one: ``param_groups`` (learning rate), ``step()``, ``zero_grad()``."""

    kinds: tuple[str, ...] = OPTIMIZERS  # the train.optimizer values this class builds

    def __init__(self, layout: ShardLayout, optimizer: str = "adamw", lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 overlap_param_gather: bool = True, whole_modules: Sequence[nn.Module] = ()) -> None:
        """``overlap_param_gather``: the parameter all-gathers after a step are waited for by forward pre-hooks
        (the next forward starts while later layers' weights are still arriving); False waits at the step.
        ``whole_modules``: modules whose one hook waits for all their parameters, none inside them hooked (the
        compiled blocks: a hook on a module inside a compiled graph would split the graph at every layer)."""
        if optimizer not in self.kinds:
            raise ConfigError(f"train.optimizer={optimizer!r} is not one of {', '.join(self.kinds)}; "
                              "set train.optimizer=adamw or train.optimizer=lamb.")
        self.layout, self.mesh, self.kind = layout, layout.mesh, optimizer
        self.overlap_param_gather = overlap_param_gather
        self.named_params = layout.named_params
        self.segments = layout.shard_segments()
        device = self.named_params[0][1].device if self.named_params else self.mesh.device
        # Views (updates land in the parameters), or fp32 master copies when the replicas hold rounded weights.
        self.separate_masters = (getattr(layout, "gather_dtype", torch.float32) != torch.float32
                                 or getattr(layout, "param_dtype", torch.float32) != torch.float32)
        self.tensors = [nn.Parameter(_master_of(s) if self.separate_masters else s.data) for s in self.segments]
        if hasattr(layout, "release_master_init"):
            layout.release_master_init()
        for t, s in zip(self.tensors, self.segments, strict=True):
            t.grad = s.grad
        decay = [i for i, s in enumerate(self.segments) if self.named_params[s.owner][1].ndim >= 2]
        no_decay = [i for i, s in enumerate(self.segments) if self.named_params[s.owner][1].ndim < 2]
        # (indices, weight decay) per parameter group; an empty group would be refused on some ranks
        split = [(idx, wd) for idx, wd in ((decay, weight_decay), (no_decay, 0.0)) if idx]
        self.inner: torch.optim.Optimizer = self._build_inner(split, lr, betas, eps, weight_decay, device)
        self._hooks = register_param_waits(layout, whole_modules)

    def _build_inner(self, split: list[tuple[list[int], float]], lr: float, betas: tuple[float, float],
                     eps: float, weight_decay: float, device: torch.device) -> torch.optim.Optimizer:
        """The torch optimizer over the shard's tensors (``split``: (segment indices, weight decay) per parameter
        group), its state created eagerly. Its own method so that optimizers of other kinds (Muon,
        megaloom/optim/muon.py) reuse the segments, masters and hooks built around it."""
        optimizer = self.kind
        fused = accelerator.fused_optimizer(device)
        if optimizer == "adamw" and not fused:
            # The foreach AdamW allocates sqrt(exp_avg_sq) for a whole parameter group at once (4 bytes per element
            # of the shard); stepping groups of about STEP_GROUP_ELEMENTS bounds it. Elementwise: the same values.
            split = [(part, wd) for idx, wd in split
                     for part in step_groups(idx, [self.tensors[i].numel() for i in idx], STEP_GROUP_ELEMENTS)]
        order = [idx for idx, _ in split]
        groups = [{"params": [self.tensors[i] for i in idx], "weight_decay": wd} for idx, wd in split]
        if optimizer == "adamw":
            inner: torch.optim.Optimizer = torch.optim.AdamW(
                groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=fused,
                foreach=None if fused else True)
        else:
            owners = [self.segments[i].owner for idx in order for i in idx]
            params = [p for _, p in self.named_params]
            inner = Lamb(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         norm_sync=shard_norm_sync(owners, params, self.mesh, self.layout.group))
        # Step counters: on the device for the fused AdamW kernel, on the host otherwise (LAMB reads them).
        step_device = device if fused and optimizer == "adamw" else torch.device("cpu")
        for t in self.tensors:  # eagerly, so memory is what it will be and checkpoints have a template
            inner.state[t] = {"step": torch.zeros((), dtype=torch.float32, device=step_device),
                              "exp_avg": torch.zeros_like(t), "exp_avg_sq": torch.zeros_like(t)}
        return inner

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    @torch.no_grad()
    def step(self) -> None:
        self.layout.wait_params()  # the previous gather reads this rank's chunk: let it land first
        for t, g in zip(self.tensors, self.layout.segment_grads(self.segments), strict=True):
            t.grad = g
        self.inner.step()
        self.publish_masters()
        self.layout.publish_params(self.overlap_param_gather)

    @torch.no_grad()
    def publish_masters(self) -> None:
        """Separate fp32 masters: write them into this rank's chunk of the parameters (the gather rounds it)."""
        if self.separate_masters and self.tensors:
            torch._foreach_copy_([s.data for s in self.segments], [t.detach() for t in self.tensors])

    @torch.no_grad()
    def weights_loaded(self, masters_loaded: bool) -> None:
        """After loading weights with separate fp32 masters: ``masters_loaded`` (a checkpoint of this optimizer
        wrote the master shards) or not (the parameters were written; the masters copy them). Then every
        replica's parameters come from the masters (collective over dp)."""
        if not self.separate_masters:
            return
        self.layout.wait_params()
        if not masters_loaded and self.tensors:
            torch._foreach_copy_([t.detach() for t in self.tensors], [s.data for s in self.segments])
        self.publish_masters()
        self.layout.publish_params(overlap=False)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Model gradients are dropped (FSDP2 would accumulate into them); the shard's gradient views stay:
        the next reduction overwrites them."""
        for _, p in self.named_params:
            p.grad = None

    def state_bytes(self) -> int:
        """Bytes of optimizer state tensors on this rank (exp_avg, exp_avg_sq; step counters excluded)."""
        return sum(v.numel() * v.element_size() for st in self.inner.state.values() for v in st.values()
                   if torch.is_tensor(v) and v.ndim > 0)


def _master_of(s: Segment) -> torch.Tensor:
    """A segment's fp32 master: the build's fp32 values where the parameters are held in bf16
    (train.bf16_params), else a copy of the (fp32) parameters."""
    return s.master_init.clone() if s.master_init is not None else s.data.detach().float().clone()


# ------------------------------------------------------------------------------------------------ building


def build_data_parallel(model: nn.Module, mesh: Mesh, zero: int = 0, bucket_mb: float = DEFAULT_BUCKET_MB,
                        param_dtype: torch.dtype = torch.float32, tied: nn.Parameter | None = None,
                        tied_group: comm.Group = None, pad_multiple: int = 1,
                        low_precision_params: bool = False) -> DataParallelGrads | FullyShardedGrads:
    """The gradient side for ``parallel.zero``: buckets (0, 1, 2) or FSDP2 (3). ``param_dtype``: what the
    parameter all-gathers move (bf16 when training in bf16); ``tied``/``tied_group``: a pipeline stage's copy
    of the embedding tied across stages (see DataParallelGrads); ``pad_multiple``: buckets padded to a multiple
    of the group size times it (8 for 1-bit optimizers, megaloom/optim/onebit.py)."""
    if zero not in (0, 1, 2, 3):
        raise ConfigError(f"parallel.zero={zero} is not a ZeRO stage; use 0 (off), 1 (optimizer state), "
                          "2 (+ gradients) or 3 (+ parameters).")
    if zero == 3:
        if tied is not None:
            raise ConfigError("parallel.zero=3 with parallel.pp>1 is not available (FSDP2 would shard each stage "
                              "and its tied embedding copy on its own); use parallel.zero=1 or 2 with pipelines.")
        return FullyShardedGrads(model, mesh, param_dtype)
    if low_precision_params and zero == 3:
        raise ConfigError("train.bf16_params=true with parallel.zero=3: FSDP2 keeps its own mixed-precision policy "
                          "(bf16 gathers of fp32 shards); set train.bf16_params=false or auto.")
    return DataParallelGrads(model, mesh, zero, bucket_mb, tied, tied_group, param_dtype, pad_multiple,
                             low_precision_params)


