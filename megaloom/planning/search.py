"""Every layout of a world that training accepts, with its predicted memory and step, best first.

The candidates: tp over the sizes the model's heads allow (parallel/mesh.py `tp_sizes_for_model`) that fit in a
node; cp 1, 2, 4 (8 from 32k tokens); pp over the divisors of what is left; vpp 1 to 8 (interleaved schedule),
each with the layers split evenly or, where they do not divide, with the most balanced end-stage counts
(`partition.end_stage_options`: Llama 3's 126 layers on 16 ranks take 7 on each end rank); ep over the
divisors of the experts (MoE); micro-batch 1, 2, 4, 8 where the global
batch divides; ZeRO 1 (3 without a pipeline); sp whenever tp > 1; the least recomputation (none, selective, full)
that fits. Each candidate
goes through the same refusals as `megaloom train` (config validation and `megaloom.preflight`), so nothing the
training would refuse is proposed; then the memory plan of its first and last pipeline stage, with
``train.recompute_casts`` turned on only where it is needed to fit (as `auto` decides), under 95% of the GPU; then
the step (`planning.step.predict`). The plan is pure arithmetic on the config (no module, no tensor), so a search
over 16,384 GPUs takes seconds.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator

from megaloom.accelerator import CUDA
from megaloom.config import Config, ConfigError, validate
from megaloom.parallel.mesh import tp_sizes_for_model
from megaloom.parallel.pipeline.partition import end_stage_options
from megaloom.planning.hardware import GpuKind
from megaloom.planning.memory_plan import GB, MemoryPlan, plan_memory
from megaloom.planning.step import Prediction, predict
from megaloom.preflight import preflight

HEADROOM = 0.95  # of the GPU's memory a plan may use (as memory_fit)
RECOMPUTE = ("none", "selective", "full")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(cfg: Config, world: int, gpu: GpuKind) -> Iterator[Config]:
    """Layouts of ``cfg`` at ``world`` GPUs (module doc), before any check."""
    m, t = cfg.model, cfg.train
    tps = [x for x in tp_sizes_for_model(m, gpu.gpus_per_node) if world % x == 0]
    cps = [c for c in (1, 2, 4, 8) if c == 1 or t.seq_len >= (32768 if c == 8 else 8192)]
    eps = [e for e in _divisors(m.n_experts) if e <= 64] if m.moe_every else [1]
    for tp in tps:
        for cp in cps:
            if world % (tp * cp):
                continue
            rest = world // (tp * cp)
            for pp in _divisors(rest):
                if pp > m.n_layers:
                    continue
                dp = rest // pp
                for vpp in range(1, 9) if pp > 1 else (1,):
                    # layers that do not divide: the most balanced end-stage counts (Llama 3's 126 on 16 ranks)
                    for first, last in end_stage_options(m.n_layers, pp, vpp)[:1]:
                        yield from _per_stage_layout(cfg, t, dp, eps, tp=tp, cp=cp, pp=pp, vpp=vpp, ends=(first, last))


def _per_stage_layout(cfg: Config, t, dp: int, eps: list[int], *, tp: int, cp: int, pp: int, vpp: int,
                      ends: tuple[int, int]) -> Iterator[Config]:
    """The expert, micro-batch and ZeRO choices of one (tp, cp, pp, vpp, end stages)."""
    for ep in eps:
        if dp % ep:
            continue
        for mb in (1, 2, 4, 8):
            if t.global_batch_size % (dp * mb):
                continue
            for zero in ((1, 3) if pp == 1 else (1,)) if dp > 1 else (0,):
                yield _layout(cfg, tp=tp, cp=cp, pp=pp, vpp=vpp, ep=ep, mb=mb, zero=zero, recompute="none",
                              ends=ends)


def _layout(cfg: Config, *, tp: int, cp: int, pp: int, vpp: int, ep: int, mb: int, zero: int,
            recompute: str, ends: tuple[int, int] = (0, 0)) -> Config:
    """The layout applied to the user's config (its levers still "auto": resolved per layout, as a GPU run
    resolves them for its own layout)."""
    p = dataclasses.replace(cfg.parallel, tp=tp, cp=cp, pp=pp, vpp=vpp, ep=ep, zero=zero, sp=tp > 1,
                            schedule="interleaved" if vpp > 1 else "1f1b" if pp > 1 else cfg.parallel.schedule,
                            pp_first_stage_layers=ends[0], pp_last_stage_layers=ends[1])
    t = dataclasses.replace(cfg.train, micro_batch_size=mb, recompute=recompute, recompute_layers=0)
    return dataclasses.replace(cfg, parallel=p, train=t)


def resolved(cfg: Config) -> Config:
    """The levers left at auto, as a CUDA run of this layout chooses them (planning/levers.py)."""
    from megaloom.planning.levers import resolve_levers

    return resolve_levers(cfg, CUDA)[0]


def accepted(cfg: Config, world: int) -> bool:
    """What `megaloom train` would accept at this world size (config validation and preflight)."""
    try:
        validate(cfg)
        preflight(cfg, world, local_world_size=1)
    except (ConfigError, ValueError):
        return False
    return True


def fit_memory(cfg: Config, world: int, gpu: GpuKind) -> tuple[Config, MemoryPlan, int] | None:
    """(``cfg`` with train.recompute_casts decided as `auto` would: on only if needed, the plan of its fuller
    stage, that stage) if its first and last stage fit under HEADROOM of the GPU; None if they do not even so."""
    budget = HEADROOM * gpu.memory_gb * GB
    stages = sorted({0, cfg.parallel.pp - 1})
    n_micro = _planned_micro_batches(cfg, world)
    options = (False, True) if cfg.train.compile is True and cfg.train.recompute_casts == "auto" else \
        (cfg.train.recompute_casts is True,)
    for lean in options:
        trial = copy.deepcopy(cfg)
        trial.train.recompute_casts = lean
        plans = [(plan_memory(trial, world_size=world, device=CUDA, pp_rank=r, n_micro=n_micro), r)
                 for r in stages]
        plan, stage = max(plans, key=lambda pr: pr[0].peak)
        if plan.peak <= budget:
            return trial, plan, stage
    return None


def _planned_micro_batches(cfg: Config, world: int) -> int:
    """The micro-batches the memory plan plays: all of them up to twice the pipeline's depth, beyond which the
    schedule only repeats its steady state (its peak is reached before: at most pp x vpp micro-batches are in
    flight), so a step of hundreds of micro-batches is planned as fast as one of a few."""
    p, t = cfg.parallel, cfg.train
    dp = world // (p.tp * p.pp * p.cp)
    m = max(1, t.global_batch_size // (dp * t.micro_batch_size))
    if p.pp == 1:
        return min(m, 2)
    bound = 2 * p.pp
    return m if m <= bound else bound


@dataclasses.dataclass
class Option:
    cfg: Config
    prediction: Prediction


def search(cfg: Config, world: int, gpu: GpuKind, top: int = 10) -> tuple[list[Option], dict[str, int]]:
    """The ``top`` accepted layouts that fit, by predicted tokens/s; and the counts of what was dropped why."""
    counts = {"candidates": 0, "refused": 0, "do not fit": 0, "predicted": 0}
    options: list[Option] = []
    for cand in candidates(cfg, world, gpu):
        counts["candidates"] += 1
        cand = resolved(cand)
        if not accepted(cand, world):
            counts["refused"] += 1
            continue
        fitted = None
        for mode in RECOMPUTE:  # the least recomputation that fits (more would only cost time)
            fitted = fit_memory(dataclasses.replace(cand, train=dataclasses.replace(cand.train, recompute=mode)),
                                world, gpu)
            if fitted is not None:
                break
        if fitted is None:
            counts["do not fit"] += 1
            continue
        chosen, plan, stage = fitted
        pred = predict(chosen, world, gpu, memory=False)
        pred.memory_gb, pred.memory_stage, pred.memory_phase = plan.peak / GB, stage, plan.peak_phase
        counts["predicted"] += 1
        options.append(Option(chosen, pred))
    options.sort(key=lambda o: -o.prediction.tokens_per_s)
    return options[:top], counts
