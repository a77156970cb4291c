"""The process mesh: which rank holds which slice of the model and the data, and the groups that connect them.

A world of W processes is a 4-D grid of sizes (pp, dp, cp, tp) with dp = W / (tp * pp * cp). The rank
order is a string naming the dimensions outermost first; the default ``"pp-dp-cp-tp"`` puts tp innermost
so that a tensor-parallel group (the chattiest: several collectives per layer) lands on consecutive
ranks, i.e. on the GPUs of one node behind NVLink, while pipeline stages (point-to-point only) span nodes.

Expert parallelism is carved out of dp: an ep group is a block of ``ep`` consecutive dp indices with
all other coordinates equal, and the expert-data-parallel (edp) group holds the dp ranks that own the same
experts (dp indices equal modulo ep, and every cp index), which is where expert gradients are averaged.

Everything here except `Mesh.build` is pure arithmetic, so layouts are checked (and tested) without
starting a single process. No module-level state: process groups live on the Mesh object, which is
passed to every piece of parallel code.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from megaloom.config import Config, ConfigError, ModelConfig
from megaloom.model_keys.shape import resolved_ffn_dim, resolved_kv_heads
from megaloom.parallel.comm import NullRecorder, OpRecorder
from megaloom.parallel.groups import partition_group

DIMS = ("pp", "dp", "cp", "tp")
DEFAULT_ORDER = "pp-dp-cp-tp"
# Group kinds in the one order every rank creates them (one collective creation call per kind, groups.py).
GROUP_KINDS = ("tp", "cp", "dp", "pp", "dp_cp", "ep", "edp")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _fmt(values: list[int], limit: int = 8) -> str:
    return ", ".join(map(str, values[:limit])) + (", ..." if len(values) > limit else "")


def init_timeout(cfg: Config) -> timedelta:
    """The training groups' timeout until the first step has finished (`resilience.init_timeout_s`, 0 = twice
    the collective timeout): start-up, compilation and communicator set-up take longer than a step. After step 1
    `runtime.shorten_timeouts` sets `collective_timeout` (TorchTitan's init and train timeouts)."""
    r = cfg.resilience
    return timedelta(seconds=r.init_timeout_s or 2 * r.collective_timeout_s)


def tp_sizes_for_model(m: ModelConfig, limit: int = 64) -> list[int]:
    """Tensor-parallel sizes this model shape can be split into (heads, KV heads and MLP all divide)."""
    kv = resolved_kv_heads(m)
    ffn = resolved_ffn_dim(m)
    return [t for t in range(1, limit + 1)
            if m.n_heads % t == 0 and (kv % t == 0 or t % kv == 0) and ffn % t == 0
            and (m.vocab_size == 0 or m.vocab_size % t == 0)]


def check_tp_model(m: ModelConfig, tp: int) -> None:
    """The model-shape half of `validate_layout`: can every tensor-parallel layer be split tp ways?"""
    if tp == 1:
        return
    kv = resolved_kv_heads(m)
    works = f"parallel.tp values this model supports: {_fmt(tp_sizes_for_model(m))}."
    if m.n_heads % tp:
        raise ConfigError(f"parallel.tp={tp} does not divide model.n_heads={m.n_heads} (each tp rank owns "
                          f"whole attention heads). {works}")
    if kv % tp and tp % kv:
        raise ConfigError(f"parallel.tp={tp} and model.n_kv_heads={kv}: one must divide the other (each tp "
                          f"rank owns whole KV heads, or one replicated KV head when tp > n_kv_heads). "
                          f"{works}")
    ffn = resolved_ffn_dim(m)
    if ffn % tp:
        raise ConfigError(f"parallel.tp={tp} does not divide the MLP width {ffn} "
                          f"(model.ffn_dim={m.ffn_dim}); model.ffn_dim={math.ceil(ffn / tp) * tp} would "
                          f"work. {works}")
    if m.vocab_size and m.vocab_size % tp:
        padded = math.ceil(m.vocab_size / (64 * tp)) * 64 * tp
        raise ConfigError(f"parallel.tp={tp} does not divide model.vocab_size={m.vocab_size} (the embedding "
                          f"and the output head are split by vocabulary rows); pad it, e.g. "
                          f"model.vocab_size={padded}.")


def validate_layout(cfg: Config, world_size: int) -> dict[str, int]:
    """Check that ``cfg.parallel`` fits ``world_size`` processes and the model shape; return the sizes.

    Pure (no process groups), so the launcher and tests call it before anything starts. Every error names
    the setting, what was found and sizes that would work. Returns {world, tp, pp, cp, dp, ep, edp}.
    """
    p, m, t = cfg.parallel, cfg.model, cfg.train
    if world_size < 1:
        raise ConfigError(f"world size must be >= 1, got {world_size}.")
    model_parallel = p.tp * p.pp * p.cp
    if world_size % model_parallel:
        fits = [d for d in _divisors(world_size) if world_size % (d * p.pp * p.cp) == 0]
        hint = (f"with pp={p.pp} and cp={p.cp}, parallel.tp can be {_fmt(fits)}" if fits else
                f"parallel.tp * parallel.pp * parallel.cp must be one of {_fmt(_divisors(world_size), 12)}")
        raise ConfigError(f"parallel.tp*pp*cp = {p.tp}*{p.pp}*{p.cp} = {model_parallel} does not divide the "
                          f"world size {world_size} (data parallelism takes the remaining factor); {hint}.")
    dp = world_size // model_parallel
    check_tp_model(m, p.tp)
    if p.sp and p.tp > 1 and t.seq_len % (p.tp * p.cp):
        step = p.tp * p.cp
        lo, hi = max(step, t.seq_len // step * step), math.ceil(t.seq_len / step) * step
        raise ConfigError(f"parallel.sp=true splits each sequence over tp*cp={step} ranks, but train.seq_len="
                          f"{t.seq_len} is not divisible by {step}; train.seq_len={lo} or {hi} would work "
                          f"(or parallel.sp=false).")
    if dp % p.ep:
        raise ConfigError(f"parallel.ep={p.ep} must divide the data-parallel size {dp} (world {world_size} / "
                          f"(tp*pp*cp = {model_parallel})); ep values that would work: "
                          f"{_fmt(_divisors(dp))}.")
    per_step = (t.micro_batch_size or 1) * dp  # micro_batch_size 0 (auto) is chosen later as a divisor of the rest
    if t.global_batch_size % per_step:
        lo = max(per_step, t.global_batch_size // per_step * per_step)
        raise ConfigError(f"train.global_batch_size={t.global_batch_size} must be a multiple of "
                          f"train.micro_batch_size ({t.micro_batch_size}) times the data-parallel size "
                          f"({dp}) = {per_step}; train.global_batch_size={lo} or {lo + per_step} would work.")
    return dict(world=world_size, tp=p.tp, pp=p.pp, cp=p.cp, dp=dp, ep=p.ep, edp=dp // p.ep * p.cp)


def parse_order(order: str) -> tuple[str, ...]:
    """``"pp-dp-cp-tp"`` -> ('pp', 'dp', 'cp', 'tp'): the dimensions, outermost (slowest-varying) first."""
    dims = tuple(d.strip() for d in order.split("-"))
    if sorted(dims) != sorted(DIMS):
        raise ConfigError(f"mesh order {order!r} must name each of pp, dp, cp, tp exactly once, separated by "
                          f"'-' (e.g. {DEFAULT_ORDER!r}, tp innermost).")
    return dims


def rank_coords(rank: int, sizes: dict[str, int], order: str = DEFAULT_ORDER) -> dict[str, int]:
    """Coordinates of ``rank`` in the (pp, dp, cp, tp) grid; the last dimension of ``order`` varies
    fastest."""
    coords: dict[str, int] = {}
    for d in reversed(parse_order(order)):
        coords[d] = rank % sizes[d]
        rank //= sizes[d]
    return {d: coords[d] for d in DIMS}


def _grouped(keys: dict[int, tuple]) -> list[list[int]]:
    """Ranks with equal keys form a group; groups in order of their lowest rank, ranks ascending."""
    groups: dict[tuple, list[int]] = {}
    for r in sorted(keys):
        groups.setdefault(keys[r], []).append(r)
    return list(groups.values())


def mesh_layout(world_size: int, sizes: dict[str, int],
                order: str = DEFAULT_ORDER) -> dict[str, list[list[int]]]:
    """Every group of every kind as lists of global ranks, e.g. layout['tp'] = [[0, 1], [2, 3], ...].

    ``sizes`` needs tp, pp, cp, dp (their product must be world_size) and optionally ep (default 1).
    Ranks inside a group are ascending, which is also their order along that dimension, so a rank's
    index in its group equals its coordinate (what torch.distributed reports as the group rank).
    """
    if math.prod(sizes[d] for d in DIMS) != world_size:
        raise ConfigError(f"mesh sizes {[sizes[d] for d in DIMS]} (pp, dp, cp, tp) do not multiply to the "
                          f"world size {world_size}.")
    ep = sizes.get("ep", 1)
    if sizes["dp"] % ep:
        raise ConfigError(f"parallel.ep={ep} must divide the data-parallel size {sizes['dp']}; "
                          f"ep values that would work: {_fmt(_divisors(sizes['dp']))}.")
    coords = {r: rank_coords(r, sizes, order) for r in range(world_size)}

    def key(c: dict[str, int], drop: tuple[str, ...]) -> tuple:
        return tuple(c[d] for d in DIMS if d not in drop)

    layout = {d: _grouped({r: key(c, (d,)) for r, c in coords.items()}) for d in ("tp", "cp", "dp", "pp")}
    layout["dp_cp"] = _grouped({r: key(c, ("dp", "cp")) for r, c in coords.items()})
    # ep: a block of ep consecutive dp indices; edp: the dp indices that are equal modulo ep, over every cp rank
    # (cp ranks hold other tokens of the same sequences: their expert gradients are summed like dp_cp's).
    layout["ep"] = _grouped({r: key(c, ("dp",)) + (c["dp"] // ep,) for r, c in coords.items()})
    layout["edp"] = _grouped({r: key(c, ("dp", "cp")) + (c["dp"] % ep,) for r, c in coords.items()})
    return {k: layout[k] for k in GROUP_KINDS}


@dataclass(eq=False)  # identity semantics: a mesh is a handle on process groups
class Mesh:
    """This rank's place in the process grid and its process groups.

    Sizes: tp, pp, dp, cp, ep. Coordinates: tp_rank, pp_rank, dp_rank, cp_rank, ep_rank (= dp_rank % ep).
    Groups: tp_group, pp_group, dp_group, cp_group, ep_group, edp_group, dp_cp_group (gradient reduction
    when context parallelism also splits the batch). ``Mesh.single()`` has every size 1 and every group
    None; megaloom.parallel.comm treats a None group as "no peers", so every parallel code path degenerates
    to the single-process one. (None never means the default WORLD group here.)
    """

    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    world_size: int = 1
    rank: int = 0
    order: str = DEFAULT_ORDER
    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    tp_rank: int = 0
    pp_rank: int = 0
    dp_rank: int = 0
    cp_rank: int = 0
    ep_rank: int = 0
    tp_group: Any = None
    pp_group: Any = None
    dp_group: Any = None
    cp_group: Any = None
    ep_group: Any = None
    edp_group: Any = None
    dp_cp_group: Any = None
    # Global ranks of the neighbouring pipeline stages (a ring: the last stage's next is the first, which the
    # interleaved schedule uses); equal to `rank` when pp == 1.
    pp_prev: int = 0
    pp_next: int = 0
    init_seconds: float = 0.0
    # Timeout of the groups this mesh's builders create (resilience.collective_timeout_s); None = torch's default.
    group_timeout: timedelta | None = None
    group_calls: int = 0  # process-group creation calls this rank made in `build` (one per distinct kind)
    group_paths: dict[str, int] = field(default_factory=dict)  # those calls by path: "split" / "new_group"
    # Training groups made for this mesh outside `build` (the pipeline's embedding pair): `training_groups` lists
    # them with the mesh's own, for the timeout change after the first step.
    extra_groups: list[Any] = field(default_factory=list)
    # Records the collective in flight for a watchdog; replace with comm.LastOpRecorder() to enable.
    recorder: OpRecorder = field(default_factory=NullRecorder)

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def sizes(self) -> dict[str, int]:
        return dict(pp=self.pp, dp=self.dp, cp=self.cp, tp=self.tp, ep=self.ep)

    def describe(self) -> str:
        return (f"rank {self.rank}/{self.world_size} ({self.order}): pp {self.pp_rank}/{self.pp} "
                f"dp {self.dp_rank}/{self.dp} cp {self.cp_rank}/{self.cp} tp {self.tp_rank}/{self.tp} "
                f"ep {self.ep_rank}/{self.ep}")

    def group_names(self) -> dict[Any, str]:
        """This rank's process groups -> the kinds they serve, e.g. {tp group: "tp", dp group: "dp/dp_cp/edp"}:
        kinds with identical rank lists share one group object (`build`) and are named together. Groups of one
        rank carry no traffic (comm skips them) and are left out. What `comm.CommTally` reports under."""
        names: dict[Any, list[str]] = {}
        for kind in GROUP_KINDS:
            g = getattr(self, f"{kind}_group")
            if g is not None and g.size() > 1:
                names.setdefault(g, []).append(kind)
        return {g: "/".join(kinds) for g, kinds in names.items()}

    def training_groups(self) -> list[Any]:
        """Every process group this rank trains over (each once): the mesh's kinds and `extra_groups`."""
        out: list[Any] = []
        for g in [*(getattr(self, f"{kind}_group") for kind in GROUP_KINDS), *self.extra_groups]:
            if g is not None and all(g is not h for h in out):
                out.append(g)
        return out

    def __deepcopy__(self, memo: dict) -> Mesh:
        # A handle on process-wide runtime state (process groups): a copied model shares it.
        return self

    @classmethod
    def single(cls, device: torch.device | str = "cpu") -> Mesh:
        return cls(device=torch.device(device))

    @staticmethod
    def layout(world_size: int, sizes: dict[str, int],
               order: str = DEFAULT_ORDER) -> dict[str, list[list[int]]]:
        return mesh_layout(world_size, sizes, order)

    @classmethod
    def build(cls, cfg: Config, world_size: int, rank: int, device: torch.device | str,
              order: str = DEFAULT_ORDER) -> Mesh:
        """Validate the layout and create this rank's process groups.

        Collective: every rank of the (already initialised) default process group must call it with the same
        arguments. One creation call per kind of group (`groups.partition_group`: an NCCL split of the world per
        kind, or a group among its members only), never one per group of the world. Kinds with the same
        partition (e.g. dp_cp == dp when cp == 1) share one group object. World size 1 needs no process group.
        """
        start = time.perf_counter()
        sizes = validate_layout(cfg, world_size)
        coords = rank_coords(rank, sizes, order)
        mesh = cls(device=torch.device(device), world_size=world_size, rank=rank, order=order,
                   group_timeout=init_timeout(cfg),  # until step 1 is done (runtime.shorten_timeouts)
                   tp=sizes["tp"], pp=sizes["pp"], dp=sizes["dp"], cp=sizes["cp"], ep=sizes["ep"],
                   tp_rank=coords["tp"], pp_rank=coords["pp"], dp_rank=coords["dp"], cp_rank=coords["cp"],
                   ep_rank=coords["dp"] % sizes["ep"], pp_prev=rank, pp_next=rank)
        if world_size == 1:
            return mesh
        if not dist.is_initialized() or dist.get_world_size() != world_size or dist.get_rank() != rank:
            raise RuntimeError(f"Mesh.build(world_size={world_size}, rank={rank}) needs torch.distributed "
                               "initialised with that world size and rank first.")
        layout = mesh_layout(world_size, sizes, order)
        made: dict[tuple[tuple[int, ...], ...], Any] = {}
        calls: dict[str, int] = {}
        for kind in GROUP_KINDS:
            key = tuple(map(tuple, layout[kind]))
            if key not in made:
                made[key] = partition_group(layout[kind], rank, f"mesh:{kind}", calls,
                                             timeout=mesh.group_timeout)  # the run's, not NCCL's 10 min
            setattr(mesh, f"{kind}_group", made[key])
            if kind == "pp":
                ranks = next(r for r in layout["pp"] if rank in r)
                i = ranks.index(rank)
                mesh.pp_prev, mesh.pp_next = ranks[i - 1], ranks[(i + 1) % len(ranks)]
        mesh.group_calls, mesh.group_paths = sum(calls.values()), calls
        mesh.init_seconds = time.perf_counter() - start
        return mesh
