"""Dry runs: one rank of a job of any size, alone in this process, on torch's fake process group.

    megaloom train --dry-run --world 1024 [--rank 0 | last-stage | R] [--dry-run-steps 1] key=value ...

The rank is built exactly as in the real job, through the `Trainer`'s own build (preflight, mesh and every
process group, resolved config, the model on meta, split by its parallel plan, cut to this rank's pipeline
stages, this rank's slices materialised, pipeline executors / gradient reduction, optimizer); only the process
group is torch's fake backend (`runtime.init_fake_runtime`: collectives return at once and move no data, the
tool TorchTitan's dry runs use) and the tokens are synthetic (no corpus is read). Then it runs real training
steps on real tensors (the losses mean nothing: no rank's numbers reach another), saves this rank's shard, and
reports:

- the rank's coordinates and what ran;
- build times: mesh (every process group), model (meta build, plan, pipeline cut), materialize, optimizer;
- memory: the memory plan's prediction for this rank (`plan_memory` with the built module) beside what was
  measured: the peak resident set above the one before the build on CPU (``/proc/self/status`` VmHWM, reset
  before each phase), the caching allocator's peak on an accelerator (`accelerator.max_memory_allocated`);
  weights and optimizer state also counted;
- the collectives of each step, calls and bytes per group (`comm.CommTally` on ``mesh.recorder``): tp, pp, dp
  (named with the kinds that share the group, e.g. dp/dp_cp/edp), the tied-embedding pair, point-to-point
  sends and receives one by one. Compiled blocks issue their tensor-parallel collectives from inside their
  graphs, where no recorder runs (parallel/borders.py): with train.compile the counts come from one more
  step run eagerly (``torch.compiler.set_stance("force_eager")``) that issues the same collectives
  (`sp_linear.collectives_as_compiled`);
- on a GPU, where the step's time goes (`profile_rank`): one more step under the profiler, its kernel time by
  kind, the GPU's busy fraction of the unprofiled step, the rank's floor (its GEMMs at the GPU's measured matmul
  ceiling, attention as it ran, the optimizer at HBM bandwidth) and its compute-only MFU (collectives free);
- the checkpoint of this rank's shard: DCP cannot plan a collective save on the fake group (its coordinator
  gets N copies of this rank's plan, which do not tile the tensors), so it is written with ``no_dist=True``:
  this rank's slices, under the same names and global offsets a real save gives them.

Memory budget: before the steps, the plan's peak is compared with the budget (default 90% of the memory
available when the dry run starts; on GPU, the device's memory). A rank whose steady-state step does not fit
runs its steps without the optimizer update (no optimizer state: forward, backward, gradient reduction and
clipping), predicted by ``plan_memory(update=False)``; one whose step does not fit even so is built only.
The report says which.

Settings a dry run changes, because they need other processes, files or threads: checkpoint.async_save=false
(its gloo group cannot start on a fake store), checkpoint.resume=none, data.num_workers=0, run.tensorboard=false,
run.trackers empty, resilience (nan_guard, watchdog, heartbeat, stragglers) off: garbage in unfilled receive
buffers must not skip an update. What a rank reads on the host from a peer (Python objects, split sizes: the
expert dispatch's counts) never crosses the fake group: `comm`'s exchange functions answer locally with what a
balanced, uniform job's rank would receive (balanced expert routing, said in the report). A CPU test runs dry
runs on a fake group that returns garbage (tests/garbage_group.py), as a GPU's does.
The run directory is a temporary one, removed at the end unless ``keep_dir`` is given.
"""

from __future__ import annotations

import copy
import ctypes
import dataclasses
import re
import resource
import shutil
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from megaloom import accelerator
from megaloom.config import Config, ConfigError, resolved_head_dim
from megaloom.observe.log import get_logger
from megaloom.parallel import comm
from megaloom.parallel.mesh import DEFAULT_ORDER, Mesh, rank_coords
from megaloom.planning.memory_plan import GB, MemoryPlan, plan_memory
from megaloom.preflight import preflight

log = get_logger(__name__)
BUDGET_FRACTION = 0.9  # of the memory available at the start, when no budget is given
EXTRA_STEPS = 3  # after the timed steps: the profiler's warm-up and profiled step (GPU), the eager counting step


# ------------------------------------------------------------------------------------------- synthetic data


class SyntheticTokens:
    """``n`` rows of ``seq_len + 1`` token ids below ``vocab``, row i drawn from (seed, i): what a dry run trains
    on instead of a corpus (indexable like megaloom's datasets)."""

    def __init__(self, n: int, seq_len: int, vocab: int, seed: int) -> None:
        self.n, self.seq_len, self.vocab, self.seed = n, seq_len, vocab, seed

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        if not 0 <= i < self.n:
            raise IndexError(f"synthetic row {i} out of range ({self.n} rows)")
        return np.random.default_rng((self.seed, i)).integers(0, self.vocab, self.seq_len + 1, dtype=np.int64)


@dataclass(frozen=True)
class SyntheticTokenizer:
    vocab_size: int
    path: str = ""  # no file: the resolved config keeps data.tokenizer as given
    eod_id: int = 0  # data.document_mask: synthetic tokens end a "document" wherever a 0 is drawn


def synthetic_datasets(vocab: int):
    """A `build_datasets` stand-in (the Trainer's ``datasets`` hook) returning synthetic tokens."""

    def build(data_cfg, seq_len: int, seed: int, n_train: int, n_valid: int):
        return (SyntheticTokens(n_train, seq_len, vocab, seed), SyntheticTokens(n_valid, seq_len, vocab, seed + 1),
                SyntheticTokenizer(vocab))

    return build


# ---------------------------------------------------------------------------------------------- the rank


def last_stage_rank(world: int, sizes: dict[str, int], order: str = DEFAULT_ORDER) -> int:
    """The lowest global rank of the last pipeline stage: the last member of some pipeline group."""
    return min(group[-1] for group in Mesh.layout(world, sizes, order)["pp"])


def pick_rank(choice: str | int, world: int, sizes: dict[str, int], order: str = DEFAULT_ORDER) -> int:
    """``--rank``: an integer in [0, world), "first"/"0", or "last-stage" (the first rank of the last pipeline
    stage)."""
    if isinstance(choice, str) and choice.strip().lower() in ("last-stage", "last_stage", "last"):
        return last_stage_rank(world, sizes, order)
    if isinstance(choice, str) and choice.strip().lower() == "first":
        return 0
    try:
        rank = int(choice)
    except (TypeError, ValueError):
        raise ConfigError(f"--rank {choice!r}: give a rank number (0..{world - 1}) or 'last-stage'.") from None
    if not 0 <= rank < world:
        raise ConfigError(f"--rank {rank} is outside the world of {world} ranks (0..{world - 1}).")
    return rank


def dry_run_config(cfg: Config, steps: int, run_dir: Path) -> Config:
    """A copy of ``cfg`` with the settings a dry run changes (module doc)."""
    cfg = copy.deepcopy(cfg)
    cfg.train.steps = steps + EXTRA_STEPS  # the data of the timed steps and of the profiled / counting ones
    cfg.data.num_workers = 0
    cfg.checkpoint.async_save = False
    cfg.checkpoint.resume = "none"
    cfg.checkpoint.every = 0
    cfg.run.dir = str(run_dir)
    cfg.run.tensorboard = False
    cfg.run.trackers = []  # a dry run's numbers are no experiment: no W&B or MLflow run either
    cfg.resilience = dataclasses.replace(cfg.resilience, nan_guard=False, hang_timeout_s=0.0, heartbeat=False,
                                         straggler_every=0)
    return cfg


# ------------------------------------------------------------------------------------------------- memory


def _status_kb(field_name: str) -> int | None:
    try:
        m = re.search(rf"^{field_name}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)
    except OSError:
        return None
    return int(m.group(1)) if m else None


class MemoryProbe:
    """Bytes this process holds for tensors, per phase: on an accelerator the caching allocator's peak; on CPU the
    peak resident set (VmHWM, reset by writing 5 to /proc/self/clear_refs) above the resident set at `start`."""

    def __init__(self, device: torch.device) -> None:
        self.on_device = accelerator.is_accelerator(device)
        self.device = device
        self.base = 0

    def current(self) -> int:
        if self.on_device:
            return accelerator.memory_allocated(self.device)
        kb = _status_kb("VmRSS")
        return kb * 1024 if kb is not None else 0

    def start(self) -> None:
        """The baseline (everything before the model: interpreter, libraries, process groups)."""
        self.base = self.current()

    def reset_peak(self) -> None:
        if self.on_device:
            accelerator.reset_peak_memory_stats(self.device)
            return
        try:
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            pass  # no reset: the peak below is the process's since its start (still an upper bound)

    def peak(self) -> int:
        """Peak since the last reset, above the baseline."""
        if self.on_device:
            return accelerator.max_memory_allocated(self.device) - self.base
        kb = _status_kb("VmHWM")
        if kb is None:
            kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // (1024 if sys.platform == "darwin" else 1)
        return kb * 1024 - self.base


def return_freed_memory() -> bool:
    """glibc: serve every allocation of 64 KiB or more with a mapping of its own, unmapped when freed, so that the
    resident set follows the live tensors (as the CUDA allocator's allocated bytes do). By default glibc raises
    that threshold as blocks are freed (up to 32 MiB) and keeps freed blocks in its heap, and the resident set
    then holds the high-water mark of every size class. Linux only; True when set."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024))  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False


def default_budget(device: torch.device) -> int | None:
    """Bytes a dry run may plan to use: the accelerator's memory, or 90% of the memory available now (Linux)."""
    if accelerator.is_accelerator(device):
        return accelerator.total_memory(device)
    try:
        m = re.search(r"^MemAvailable:\s+(\d+) kB", Path("/proc/meminfo").read_text(), re.M)
    except OSError:
        return None
    return int(int(m.group(1)) * 1024 * BUDGET_FRACTION) if m else None


def _tensor_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if torch.is_tensor(t) and t.device.type != "meta" and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def optimizer_state_bytes(optimizer) -> int:
    if hasattr(optimizer, "error_buffers"):  # 1-bit optimizers: their flat buffers and the exchange's errors
        return optimizer.state_bytes()
    inner = getattr(optimizer, "inner", optimizer)  # ZeRO's ShardedOptimizer wraps a torch optimizer
    return _tensor_bytes(v for st in inner.state.values() for v in st.values() if torch.is_tensor(v) and v.ndim)


class _NoUpdate:
    """Stands for the optimizer in steps that leave the update out: ``step()`` does nothing, so no optimizer
    state is ever allocated; everything else (zero_grad, grad_scale, param_groups) is the optimizer's."""

    def __init__(self, optimizer) -> None:
        object.__setattr__(self, "_inner", optimizer)

    def step(self, *args, **kwargs) -> None:
        return None

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    def __setattr__(self, name: str, value) -> None:
        setattr(self._inner, name, value)


# ------------------------------------------------------------------------------------------------- report


@dataclass
class DryRunReport:
    world: int
    rank: int
    coords: dict[str, int]  # pp, dp, cp, tp, ep of the rank
    sizes: dict[str, int]
    device: str
    mode: str  # "steps", "steps without update" or "build only"
    why: str  # why that mode
    steps: int
    seconds: dict[str, float] = field(default_factory=dict)  # build parts, step_1.., checkpoint
    groups_created: int | None = None  # process-group creation calls of Mesh.build on this rank (one per kind)
    plan: MemoryPlan | None = None  # for what ran
    plan_with_update: MemoryPlan | None = None  # the steady state with updates (when the run left them out)
    budget: int | None = None
    memory: dict[str, int] = field(default_factory=dict)  # measured / counted bytes
    comm: list[list[dict]] = field(default_factory=list)  # per step: [{group, op, calls, bytes}]
    phase_peaks: list[dict[str, int]] = field(default_factory=list)  # per step: forward/backward, update
    losses: list[float] = field(default_factory=list)
    checkpoint: dict = field(default_factory=dict)
    run_dir: str = ""
    memory_note: str = ""  # how memory was measured
    comm_note: str = ""  # how the collectives were counted
    profile: dict = field(default_factory=dict)  # GPU: one profiled step (`profile_rank`)

    @property
    def stage(self) -> str:
        pp = self.sizes["pp"]
        if pp == 1:
            return "no pipeline"
        where = ("first" if self.coords["pp"] == 0 else "last" if self.coords["pp"] == pp - 1
                 else f"middle ({self.coords['pp']})")
        return f"{where} pipeline stage"

    def measured_vs_plan(self) -> float | None:
        """(measured step peak - planned peak) / planned peak, in percent (the last step)."""
        if self.plan is None or "step_peak" not in self.memory or not self.plan.peak:
            return None
        return 100.0 * (self.memory["step_peak"] - self.plan.peak) / self.plan.peak

    def planned_phases(self) -> dict[str, int]:
        """The plan's peaks of the two measured phases: the micro-batches' forwards and backwards (forward,
        loss, head backward, recompute) and the update (gradient reduction, clipping, optimizer step)."""
        if self.plan is None:
            return {}
        ph = self.plan.phases
        return {"forward/backward": max(v for k, v in ph.items() if k != "optimizer step"),
                "update": ph["optimizer step"]}

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["plan"] = self.plan.as_dict() if self.plan is not None else None
        d["plan_with_update"] = self.plan_with_update.as_dict() if self.plan_with_update is not None else None
        d["stage"] = self.stage
        d["measured_vs_plan_pct"] = self.measured_vs_plan()
        return d

    def table(self) -> str:
        s, c = self.sizes, self.coords
        lines = [f"megaloom dry run: rank {self.rank} of {self.world} ({self.stage}; pp {c['pp']}/{s['pp']} "
                 f"dp {c['dp']}/{s['dp']} cp {c['cp']}/{s['cp']} tp {c['tp']}/{s['tp']} ep {c['ep']}/{s['ep']}) "
                 f"on {self.device}, fake process group",
                 f"  ran: {self.mode} ({self.why})"]
        sec = self.seconds
        groups = f", {self.groups_created} process-group creation calls" if self.groups_created is not None else ""
        lines.append(f"  build: mesh {sec.get('mesh', 0):.3f}s{groups}; model (meta, plan, pipeline cut) "
                     f"{sec.get('model', 0):.2f}s; materialize {sec.get('materialize', 0):.2f}s; wrappers "
                     f"{sec.get('wrappers', 0):.2f}s; optimizer {sec.get('optimizer', 0):.3f}s")
        if self.losses:
            times = ", ".join(f"{sec[f'step_{i + 1}']:.2f}s" for i in range(len(self.losses)))
            lines.append(f"  steps: {times} (losses {', '.join(f'{x:.3f}' for x in self.losses)}: meaningless, the "
                         "fake group moves no data)")
        if self.sizes.get("ep", 1) > 1:
            lines.append("  expert dispatch: balanced routing (the fake group exchanges no counts: each ep rank "
                         "receives as many rows as it sends, spread evenly over its local experts: "
                         "comm.exchange_counts)")
        m, p = self.memory, self.plan
        if p is not None:
            lines.append(f"  memory (GB = 1e9 bytes)      plan   measured  ({self.memory_note}, above the start)")
            rows = [("weights", p.weights, m.get("weights"), "counted"),
                    ("optimizer state", p.optimizer, m.get("optimizer"), "counted"),
                    ("build peak", p.build or p.weights, m.get("build_peak"), "peak"),
                    (f"step peak ({p.peak_phase})", p.peak if self.losses else None, m.get("step_peak"), "peak")]
            for name, planned, got, how in rows:
                pl = f"{planned / GB:9.2f}" if planned is not None else f"{'-':>9}"
                me = f"{got / GB:9.2f}" if got is not None else f"{'-':>9}"
                lines.append(f"    {name:<27}{pl}  {me}  {how if got is not None else ''}")
            if self.phase_peaks:
                planned = self.planned_phases()
                for name, got in self.phase_peaks[-1].items():
                    lines.append(f"    {'  ' + name + ' phase':<27}{planned[name] / GB:9.2f}  {got / GB:9.2f}  "
                                 f"({100.0 * (got - planned[name]) / planned[name]:+.1f}%)")
            err = self.measured_vs_plan()
            if err is not None:
                lines.append(f"    measured step peak vs plan: {err:+.1f}%")
            if self.plan_with_update is not None:
                lines.append(f"    (with optimizer updates the plan's peak is {self.plan_with_update.peak / GB:.2f} GB"
                             f" at the {self.plan_with_update.peak_phase}; budget "
                             f"{(self.budget or 0) / GB:.2f} GB)")
        if self.profile:
            lines.extend("  " + line for line in profile_lines(self.profile))
        if self.comm:
            last = self.comm[-1]
            how = f"; {self.comm_note}" if self.comm_note else ""
            which = "one step" if self.comm_note else f"step {len(self.comm)}"
            lines.append(f"  collectives of {which} (bytes = the op's buffer{how}):")
            lines.append(f"    {'group':<14}{'op':<22}{'calls':>7}{'MB':>12}")
            for row in last:
                lines.append(f"    {row['group']:<14}{row['op']:<22}{row['calls']:>7}{row['bytes'] / 1e6:>12.2f}")
        if self.checkpoint:
            ck = self.checkpoint
            lines.append(f"  checkpoint: {ck['bytes'] / GB:.2f} GB in {ck['files']} files, {ck['seconds']:.2f}s "
                         f"({ck['how']})")
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------- run


def dry_run(cfg: Config, world: int, rank: str | int = 0, steps: int = 1, memory_budget: int | None = None,
            keep_dir: str | Path | None = None) -> DryRunReport:
    """Build and step rank ``rank`` of a ``world``-rank job in this process (module doc); returns the report.
    ``memory_budget``: bytes (None: `default_budget`); ``keep_dir``: run directory to keep (default: a
    temporary one, removed at the end)."""
    if steps < 0:
        raise ConfigError(f"--dry-run-steps must be >= 0, got {steps}.")
    if world < 1:
        raise ConfigError(f"--world must be >= 1, got {world}.")
    checked = preflight(cfg, world)  # every layout refusal, before any process group or tensor
    sizes = checked.sizes
    r = pick_rank(rank, world, sizes)
    coords = rank_coords(r, sizes)
    coords["ep"] = coords["dp"] % sizes["ep"]
    if dist.is_initialized():
        raise RuntimeError("dry_run needs a process without a process group (it starts a fake one).")

    from megaloom.runtime import init_fake_runtime, pick_device

    device = pick_device(cfg.train.device, 0)
    budget = memory_budget if memory_budget is not None else default_budget(device)
    # Before anything is allocated: do this rank's weights fit at all? (parameters counted from the config)
    pre = _planned(cfg, world, device, coords["pp"], update=False)
    if budget is not None and pre.weights > budget:
        raise ConfigError(f"dry run: rank {r}'s weights alone are planned at {pre.weights / GB:.1f} GB, over the "
                          f"memory budget of {budget / GB:.1f} GB; nothing was built (give a larger "
                          "--dry-run-memory-gb, or more tp/pp).")

    run_dir = Path(keep_dir) if keep_dir else Path(tempfile.mkdtemp(prefix="megaloom-dryrun-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    dcfg = dry_run_config(cfg, steps, run_dir)
    report = DryRunReport(world=world, rank=r, coords=coords, sizes=sizes, device=device.type, mode="build only",
                          why="", steps=0, budget=budget, run_dir=str(run_dir))
    rt = init_fake_runtime(dcfg, world, r)
    try:
        _build_and_step(report, dcfg, rt, steps, budget, device)
    finally:
        dist.destroy_process_group()
        if not keep_dir:
            shutil.rmtree(run_dir, ignore_errors=True)
    return report


def _planned(cfg: Config, world: int, device: torch.device, pp_rank: int, update: bool, model=None,
             n_micro: int | None = None) -> MemoryPlan:
    from megaloom.planning.memory_fit import resolve_for_planning

    plan_cfg = resolve_for_planning(cfg) if cfg.model.vocab_size <= 0 else copy.deepcopy(cfg)
    if plan_cfg.train.micro_batch_size == 0:  # auto: any size gives the weights
        plan_cfg.train.micro_batch_size = 1
    return plan_memory(plan_cfg, model, world_size=world, device=device.type, pp_rank=pp_rank, n_micro=n_micro,
                       update=update)


def _build_and_step(report: DryRunReport, dcfg: Config, rt, steps: int, budget: int | None,
                    device: torch.device) -> None:
    """Build the rank, choose what fits the budget, run the steps with every collective counted, save its shard."""
    trainer, probe = _build(report, dcfg, rt, device)
    cfg, mesh = trainer.cfg, trainer.mesh
    steps = _choose_mode(report, trainer, rt.world_size, steps, budget, device)
    tally = _count_collectives(trainer)
    batches = _run_steps(report, trainer, tally, probe, steps, device)
    report.memory["optimizer"] = optimizer_state_bytes(trainer.optimizer)

    def one_step() -> None:
        batch = next(batches)
        float(trainer.train_step(batch.to(device) if batch is not None else None).loss)

    if steps and accelerator.is_accelerator(device):
        report.profile = profile_rank(trainer, one_step, report, Path(cfg.run.dir) / "profile")
    if steps and cfg.train.compile:
        _count_compiled_collectives(report, tally, one_step)
    mesh.recorder = tally.inner

    # This rank's shard of a checkpoint (module doc: no_dist).
    report.checkpoint = save_rank_shard(trainer, Path(cfg.run.dir) / "checkpoints" / f"dryrun_rank{rt.rank}")
    report.seconds["checkpoint"] = report.checkpoint["seconds"]
    trainer.guard.close()
    trainer.sink.close()


def _build(report: DryRunReport, dcfg: Config, rt, device: torch.device):
    """The rank built by the Trainer itself, on synthetic data, with the memory it took: (trainer, probe)."""
    from megaloom.training.trainer import Trainer

    torch.set_flush_denormal(True)  # unfilled receive buffers may hold denormals: keep the arithmetic fast
    probe = MemoryProbe(device)
    if device.type == "cpu":
        report.memory_note = ("resident set, malloc returning freed blocks" if return_freed_memory()
                              else "resident set (freed blocks may stay in malloc's heap: an upper bound)")
    else:
        report.memory_note = f"the {device.type} caching allocator's peak (max_memory_allocated)"
    probe.start()
    report.memory["start"] = probe.base  # what the process held before the build (interpreter, libraries)
    probe.reset_peak()
    vocab = dcfg.model.vocab_size or dcfg.data.default_vocab_size
    trainer = Trainer(dcfg, runtime=rt, datasets=synthetic_datasets(vocab)).build()
    report.memory["build_peak"] = probe.peak()
    report.groups_created = trainer.mesh.group_calls
    report.seconds.update(trainer.build_seconds)
    report.memory["weights"] = _tensor_bytes(trainer.model.parameters())
    report.memory["buffers"] = _tensor_bytes(trainer.model.buffers())  # RoPE tables and the like: not in the plan
    return trainer, probe


def _choose_mode(report: DryRunReport, trainer, world: int, steps: int, budget: int | None,
                 device: torch.device) -> int:
    """The plan for this rank, from the built module, and which steps fit the budget: full steps, steps without
    the optimizer update (the optimizer swapped for `_NoUpdate`), or none. Returns the steps to run."""
    cfg, mesh = trainer.cfg, trainer.mesh
    full = _planned(cfg, world, device, mesh.pp_rank, True, trainer.model, trainer.n_micro)
    lean = _planned(cfg, world, device, mesh.pp_rank, False, trainer.model, trainer.n_micro)
    if steps == 0:
        report.mode, report.why, report.plan = "build only", "--dry-run-steps 0", full
    elif budget is None or full.peak <= budget:
        report.mode, report.plan = f"{steps} training step(s)", full
        report.why = ("no memory budget" if budget is None else
                      f"planned peak {full.peak / GB:.2f} GB within the budget of {budget / GB:.2f} GB")
    elif lean.peak <= budget:
        report.mode, report.plan, report.plan_with_update = f"{steps} training step(s) without the optimizer " \
                                                            "update", lean, full
        report.why = (f"with updates the planned peak is {full.peak / GB:.2f} GB, over the budget of "
                      f"{budget / GB:.2f} GB; without them {lean.peak / GB:.2f} GB")
        trainer.train_step.optimizer = _NoUpdate(trainer.optimizer)
    else:
        report.mode, report.plan, report.plan_with_update = "build only", lean, full
        report.why = (f"even without optimizer updates the planned peak is {lean.peak / GB:.2f} GB, over the "
                      f"budget of {budget / GB:.2f} GB")
        steps = 0
    report.steps = steps
    return steps


def _count_collectives(trainer) -> comm.CommTally:
    """Count every collective from here on, per group: a tally in front of the mesh's recorder."""
    mesh = trainer.mesh
    names = mesh.group_names()
    grads = trainer.train_step.grads  # the tied embedding's {first, last stage} pair (pipelines)
    emb = getattr(grads, "tied_group", None) or getattr(grads, "embedding_group", None)
    if emb is not None:
        names[emb] = "emb"
    tally = comm.CommTally(names, inner=mesh.recorder)
    mesh.recorder = tally
    return tally


def _run_steps(report: DryRunReport, trainer, tally: comm.CommTally, probe: MemoryProbe, steps: int,
               device: torch.device):
    """The measured steps: time, loss, collectives and two memory phases each. Returns the batches left."""
    from megaloom.optim.build import lr_at, set_lr

    # Two measured phases per step, split where TrainStep turns from the micro-batches to the update
    # (`_update`: gradient reduction, clipping, optimizer step): each is compared with the plan's phases.
    ts, t = trainer.train_step, trainer.cfg.train
    finish_step = ts._update
    phases: dict[str, int] = {}

    def update_phase(total):
        phases["forward/backward"] = probe.peak()
        probe.reset_peak()
        return finish_step(total)

    ts._update = update_phase
    batches = iter(trainer._loader())
    for step in range(steps):
        batch = next(batches)
        batch = batch.to(device) if batch is not None else None
        set_lr(trainer.optimizer, lr_at(step, t))
        tally.reset()
        phases = {}
        probe.reset_peak()
        t0 = time.perf_counter()
        out = ts(batch)
        loss = float(out.loss)  # waits for the step (GPU)
        phases["update"] = probe.peak()
        report.seconds[f"step_{step + 1}"] = time.perf_counter() - t0
        report.losses.append(loss)
        report.comm.append(tally.rows())
        report.phase_peaks.append(phases)
        log.debug(f"dry run: step {step + 1} in {report.seconds[f'step_{step + 1}']:.2f}s, peaks {phases}")
    del ts._update  # the class's method again
    if steps:
        report.memory["step_peak"] = max(report.phase_peaks[-1].values())
    return batches


def _count_compiled_collectives(report: DryRunReport, tally: comm.CommTally, one_step) -> None:
    """Compiled blocks call no recorder (parallel/borders.py): count one eager step that issues the same
    collectives as the compiled one (the sp regions' linears as compiled, not the shard-saving path)."""
    from megaloom.parallel.sp_linear import collectives_as_compiled

    tally.reset()
    try:
        with torch.compiler.set_stance("force_eager"), collectives_as_compiled():
            one_step()
        report.comm.append(tally.rows())
        report.comm_note = "counted in one more step run eagerly, issuing what the compiled blocks issue"
    except torch.OutOfMemoryError:
        report.comm_note = ("the compiled blocks' collectives are not in these counts: the eager step that "
                            "counts them ran out of memory")


def profile_rank(trainer, one_step, report: DryRunReport, out_dir: Path) -> dict:
    """One more step under the profiler (GPU): kernel time by kind, the GPU's busy time against the unprofiled
    step (the median of the timed steps after the first, which compiles), the rank's floor (its GEMM FLOPs at
    the GPU's measured matmul ceiling, attention as the kernel ran, the optimizer's traffic at HBM bandwidth;
    observe/profile.py) and the rank's compute-only MFU: the model FLOPs of this rank's share of the step (6 x
    its matmul parameters x the tokens it processes, plus attention scores and values of its heads, counted as
    observe/flops.py counts them) over the step time less the fake group's own device copies (torch's fake
    backend fills the outputs of its all-gathers and reduce-scatters with copies on the compute stream, work a real
    group does with NCCL kernels on their own stream): the collectives free. ``mfu_step``: over the whole step."""
    from megaloom.observe.flops import device_peak_flops, matmul_params
    from megaloom.observe.profile import FAKE_GROUP_KIND, device_ceilings, floor_ms, kernel_count, profile_step

    cfg, mesh, model = trainer.cfg, trainer.mesh, trainer.model
    t = cfg.train
    timed = [report.seconds[f"step_{i + 1}"] for i in range(len(report.losses))]
    step_ms = 1e3 * float(np.median(timed[1:] if len(timed) > 1 else timed))
    b = profile_step(one_step, out_dir, mesh.device.type, moe=cfg.model.moe_every > 0, fake_group=True)
    b["kernels"] = kernel_count(out_dir / "trace.json.gz")
    tokens = trainer.n_micro * t.micro_batch_size * t.seq_len // mesh.cp  # this rank's tokens per step
    mm = matmul_params(model)
    blocks = list(model.layers.values())
    # Full recomputation runs the blocks' forward GEMMs again (the first recompute_layers of each chunk, or all).
    recomputed = 0.0
    if t.recompute == "full":
        block_mm = sum(p.numel() for blk in blocks for p in blk.parameters() if p.ndim >= 2)
        chunk = max(1, len(blocks) // max(1, cfg.parallel.vpp))
        recomputed = block_mm * (min(1.0, t.recompute_layers / chunk) if t.recompute_layers else 1.0)
    q_width = cfg.model.n_heads // mesh.tp * resolved_head_dim(cfg.model)  # this rank's query heads x head size
    attention_flop = 12.0 * len(blocks) * q_width * t.seq_len * tokens
    model_flop = 6.0 * mm * tokens + attention_flop
    updated = sum(p.numel() for p in model.parameters() if p.requires_grad)
    grads = trainer.train_step.grads
    if cfg.parallel.zero in (1, 2) and hasattr(grads, "shard_numel"):
        updated = grads.shard_numel()  # ZeRO: this rank updates its 1/dp shard
    name = accelerator.device_name(mesh.device)
    ceilings = device_ceilings(name)
    prof = {"step_ms": step_ms, "busy_ms": b["busy_ms"], "kernel_ms": sum(b["kinds_ms"].values()),
            "kinds_ms": b["kinds_ms"], "kernels": b["kernels"], "gpu_busy": min(1.0, b["busy_ms"] / step_ms),
            "tokens": tokens, "model_tflop": model_flop / 1e12, "gpu": name, "trace": str(out_dir / "trace.json.gz")}
    if ceilings is not None:
        floor = floor_ms(b["kinds_ms"], gemm_flop=6.0 * mm * tokens + 2.0 * recomputed * tokens,
                         gemm_tflops=ceilings["gemm_tflops"], optimizer_bytes=32.0 * updated,
                         hbm_tb_per_s=ceilings["hbm_tbps"])
        prof.update(floor_ms=floor, floor_total_ms=sum(floor.values()),
                    step_vs_floor=step_ms / sum(floor.values()), ceilings=ceilings)
    fake_ms = min(b["kinds_ms"].get(FAKE_GROUP_KIND, 0.0), step_ms)
    prof["fake_copy_ms"] = fake_ms
    peak = device_peak_flops(mesh.device)
    if peak:
        prof["mfu"] = model_flop / ((step_ms - fake_ms) / 1e3) / peak
        prof["mfu_step"] = model_flop / (step_ms / 1e3) / peak
    return prof


def profile_lines(prof: dict) -> list[str]:
    """The profile's table (observe/profile.table) and its summary line."""
    from megaloom.observe.profile import table

    lines = [f"GPU time by kind of one profiled step ({prof['kernels']:,} kernels; shares of the unprofiled step, "
             "the median of steps 2..N):"]
    lines += ["  " + x for x in table({"kinds_ms": prof["kinds_ms"], "busy_ms": prof["busy_ms"]}, prof["step_ms"],
                                      prof.get("floor_ms")).splitlines()]
    summary = f"GPU busy {100 * prof['gpu_busy']:.1f}% of the step"
    if "step_vs_floor" in prof:
        summary += f"; step / floor {prof['step_vs_floor']:.2f}"
    if "mfu" in prof:
        fake = prof.get("fake_copy_ms", 0.0)
        summary += (f"; compute-only MFU {100 * prof['mfu']:.1f}% ({prof['model_tflop']:.1f} TFLOP of this rank's "
                    f"model FLOPs, {prof['tokens']:,} tokens, over the step less the fake group's {fake:.1f} ms of "
                    f"copies: collectives free; {100 * prof.get('mfu_step', prof['mfu']):.1f}% of the whole step)")
    return lines + [summary]


def save_rank_shard(trainer, path: Path) -> dict:
    """Write this rank's slices of the model and optimizer state (DCP, ``no_dist=True``) and its RNG file."""
    from megaloom.checkpoint.sharded import sharded_state
    from megaloom.checkpoint.store import rng_state, write_rng, write_tensors

    t0 = time.perf_counter()
    path.mkdir(parents=True, exist_ok=True)
    state = sharded_state(trainer.model, trainer.optimizer, trainer.mesh, save=True)
    with warnings.catch_warnings():  # DCP's note that a no_dist save assumes one process: intended here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        write_tensors(path, state, no_dist=True)
    write_rng(path, trainer.rt.rank, rng_state())
    files = [p for p in path.iterdir() if p.is_file()]
    return {"path": str(path), "files": len(files), "bytes": sum(p.stat().st_size for p in files),
            "seconds": time.perf_counter() - t0,
            "how": "DCP no_dist: this rank's slices alone; the fake group cannot plan a collective save"}


def main_dry_run(cfg: Config, world: int, rank: str, steps: int, memory_gb: float | None, json_out: str | None,
                 keep_dir: str | None) -> int:
    """`megaloom train --dry-run`: run, print the report (and write it as JSON)."""
    import json

    budget = int(memory_gb * GB) if memory_gb else None
    report = dry_run(cfg, world, rank, steps, budget, keep_dir)
    if report.plan is not None and (report.rank != 0 or report.plan_with_update is not None):
        print(report.plan.table())  # (rank 0's trainer has printed its plan with updates already)
    print(report.table())
    if json_out:
        Path(json_out).write_text(json.dumps(report.as_dict(), indent=1, default=str) + "\n")
    return 0


__all__ = ["DryRunReport", "MemoryProbe", "SyntheticTokens", "dry_run", "last_stage_rank", "pick_rank",
           "profile_rank", "save_rank_shard", "synthetic_datasets"]
