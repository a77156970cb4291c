"""`megaloom memory`: the memory plan of a configuration before anything runs, and what fits a GPU.

For a layout of N processes the plan is made for every pipeline stage (the first usually holds the most
micro-batches in flight) and the worst one is shown. With ``--gpu-gb`` it also searches, for each
recomputation mode, the largest micro-batch whose predicted peak stays under the budget (keeping the number of
micro-batches per step), which is how one picks settings for a new model or GPU without trial and error.
"""

from __future__ import annotations

import copy

from megaloom.accelerator import CUDA
from megaloom.config import Config, ConfigError
from megaloom.parallel.context import check_context
from megaloom.parallel.mesh import validate_layout
from megaloom.planning.levers import resolve_levers
from megaloom.planning.memory_plan import GB, MemoryPlan, plan_memory
from megaloom.planning.shape import shaped

HEADROOM = 0.95  # the caching allocator's fragmentation: keep 5% of the budget free
NO_BUDGET_MICRO = 8  # train.micro_batch_size auto without a device memory limit (CPU): at most this


def resolve_for_planning(cfg: Config) -> Config:
    """A copy resolved as a CUDA run of it would be: the model's sizes (`shape.shaped`: the default tokenizer's
    vocabulary when model.vocab_size = 0) and the levers left at auto (planning/levers.py)."""
    return resolve_levers(shaped(cfg), CUDA)[0]


def worst_stage(cfg: Config, world_size: int, device: str = CUDA) -> tuple[int, MemoryPlan]:
    """(pipeline rank, plan) of the stage with the highest predicted peak."""
    plans = [(r, plan_memory(cfg, world_size=world_size, device=device, pp_rank=r)) for r in range(cfg.parallel.pp)]
    return max(plans, key=lambda rp: rp[1].peak)


def planned_peak(cfg: Config, world_size: int, **train) -> float:
    """Worst-stage planned peak (bytes) of ``cfg`` with some train.* settings replaced (cfg is not changed)."""
    trial = copy.deepcopy(cfg)
    for key, value in train.items():
        setattr(trial.train, key, value)
    return worst_stage(trial, world_size)[1].peak


def _largest_fitting(cfg: Config, world_size: int, budget: float, mode: str, dp: int, n_micro: int,
                     max_micro: int, **extra) -> tuple[int, float] | None:
    best = None
    for mb in range(1, max_micro + 1):
        peak = planned_peak(cfg, world_size, recompute=mode, micro_batch_size=mb,
                            global_batch_size=mb * dp * n_micro, **extra)
        if peak > budget:
            break
        best = (mb, peak)
    return best


def fit_micro_batch(cfg: Config, world_size: int, budget_gb: float, modes=("none", "selective", "full"),
                    max_micro: int = 64) -> list[dict]:
    """For each recompute mode: the largest micro-batch (<= max_micro) whose worst-stage peak fits
    ``HEADROOM * budget_gb``, keeping the micro-batches per step of ``cfg``; None when even 1 does not fit.

    When nothing fits as configured, two changes that do not change the model's numerics are tried and the one
    giving the largest micro-batch is reported (fewest changes on a tie): train.fused_loss=true (tp=1), which
    never holds the whole vocabulary's logits, and one micro-batch per step (no gradient accumulation: the
    gradients of the first micro-batch are not held through the next one's forward). A row names what it
    assumed: ``fused_loss`` and ``micro_batches`` (per step per data-parallel rank)."""
    sizes = validate_layout(cfg, world_size)
    dp = sizes["dp"]
    n_micro = max(1, cfg.train.global_batch_size // (dp * cfg.train.micro_batch_size))
    budget = HEADROOM * budget_gb * GB
    options = [(False, n_micro)]  # (turn the fused loss on, micro-batches per step)
    if not cfg.train.fused_loss and cfg.parallel.tp == 1:
        options.append((True, n_micro))
    if n_micro > 1:
        options += [(fuse, 1) for fuse, _ in list(options)]
    rows = []
    for mode in modes:
        found = []
        for changes, (fuse, micro) in enumerate(options):
            extra = {"fused_loss": True} if fuse else {}
            best = _largest_fitting(cfg, world_size, budget, mode, dp, micro, max_micro, **extra)
            if best is not None:
                found.append((best[0], -changes, best[1], fuse, micro))
            if changes == 0 and best is not None:
                break  # fits as configured: say so, without suggesting changes
        if found:
            mb, _, peak, fuse, micro = max(found)
            rows.append({"recompute": mode, "micro_batch": mb, "peak_gb": round(peak / GB, 2),
                         "fused_loss": bool(cfg.train.fused_loss or fuse), "micro_batches": micro,
                         "global_batch": mb * dp * micro})
        else:
            rows.append({"recompute": mode, "micro_batch": None, "peak_gb": None,
                         "fused_loss": bool(cfg.train.fused_loss), "micro_batches": n_micro, "global_batch": None})
    return rows


def choose_recompute_casts(cfg: Config, world_size: int, budget_gb: float | None) -> tuple[bool, str]:
    """``train.recompute_casts=auto`` (levers resolved, shapes resolved): on only where it is needed, i.e. compiled
    blocks on a GPU whose budget the plan at the configured micro-batch (1 when auto) exceeds without it; it
    costs ~1% of speed (llama3-1b-untied on an H200) and can save a third of a block's activations and every
    weight copy. Returns (choice, why)."""
    t = cfg.train
    if t.compile is not True:
        return False, "blocks not compiled"
    if budget_gb is None:
        return False, "no GPU memory to plan against"
    mb = t.micro_batch_size or 1
    plain = planned_peak(cfg, world_size, recompute_casts=False, micro_batch_size=mb)
    if plain <= HEADROOM * budget_gb * GB:
        return False, f"micro-batch {mb} fits without it"
    lean = planned_peak(cfg, world_size, recompute_casts=True, micro_batch_size=mb)
    return True, f"micro-batch {mb} planned at {plain / GB:.1f} GB without it, {lean / GB:.1f} GB with"


def auto_micro_batch(cfg: Config, world_size: int, budget_gb: float | None) -> tuple[int, float | None]:
    """``train.micro_batch_size=0``: the largest micro-batch that divides this rank's share of the global batch
    (so the global batch, and with it the training, is unchanged) and whose planned peak stays under
    ``HEADROOM * budget_gb``. Returns (micro-batch, planned peak in GB). ``budget_gb`` None (no device limit
    known, e.g. on CPU): the largest divisor up to `NO_BUDGET_MICRO` (8: what CPU runs always used; a larger one
    would only hold more activations at once). ``cfg`` has its shapes resolved."""
    sizes = validate_layout(cfg, world_size)
    local = cfg.train.global_batch_size // sizes["dp"]
    candidates = [d for d in range(local, 0, -1) if local % d == 0]
    if budget_gb is None:
        return next(d for d in candidates if d <= NO_BUDGET_MICRO), None
    peak = None
    for mb in candidates:
        peak = planned_peak(cfg, world_size, micro_batch_size=mb)
        if peak <= HEADROOM * budget_gb * GB:
            return mb, peak / GB
    raise ConfigError(f"train.micro_batch_size=0 (auto): even micro-batch 1 is planned at {peak / GB:.1f} GB, over "
                      f"{HEADROOM:.0%} of this GPU's {budget_gb:.1f} GB; set train.recompute=full (or selective), "
                      "raise parallel.tp / parallel.zero, or shorten train.seq_len (`megaloom memory` shows the plan).")


def memory_command(cfg: Config, world_size: int, gpu_gb: float | None) -> str:
    cfg = resolve_for_planning(cfg)
    validate_layout(cfg, world_size)
    check_context(cfg)  # parallel.cp: the sequence split and the attention mode fit (activations are / cp)
    lines = []
    if cfg.train.recompute_casts == "auto":  # as `megaloom train` would choose it on a GPU of gpu_gb
        cfg.train.recompute_casts, why = choose_recompute_casts(cfg, world_size, gpu_gb)
        lines.append(f"train.recompute_casts=auto -> {str(cfg.train.recompute_casts).lower()} ({why})")
    if cfg.train.micro_batch_size == 0:  # auto: as `megaloom train` would choose it on a GPU of gpu_gb
        try:
            mb, _ = auto_micro_batch(cfg, world_size, gpu_gb)
            why = f"fits {HEADROOM:.0%} of {gpu_gb:g} GB" if gpu_gb else "no --gpu-gb: at most 8"
        except ConfigError:  # nothing fits as configured: show the plan of micro-batch 1 (the fit below says more)
            mb, why = 1, f"even 1 does not fit {HEADROOM:.0%} of {gpu_gb:g} GB as configured; the plan of 1"
        cfg.train.micro_batch_size = mb
        lines.append(f"train.micro_batch_size=0 (auto) -> {mb} ({why})")
    rank, plan = worst_stage(cfg, world_size)
    lines.append(plan.table())
    if cfg.parallel.pp > 1:
        lines.append(f"(pipeline stage {rank} of {cfg.parallel.pp}: the stage with the highest peak)")
    if gpu_gb:
        sizes = validate_layout(cfg, world_size)
        n_micro = max(1, cfg.train.global_batch_size // (sizes["dp"] * cfg.train.micro_batch_size))
        fused = str(cfg.train.fused_loss).lower()
        lines.append(f"\nlargest micro-batch under {HEADROOM:.0%} of {gpu_gb:g} GB per GPU (seq {cfg.train.seq_len}, "
                     f"dp={sizes['dp']}, as configured: {n_micro} micro-batch(es) per step, "
                     f"train.fused_loss={fused}):")
        rows = fit_micro_batch(cfg, world_size, gpu_gb)
        for row in rows:
            if not row["micro_batch"]:
                lines.append(f"  recompute={row['recompute']:<10} does not fit even with micro-batch 1")
                continue
            changes = []
            if row["fused_loss"] and not cfg.train.fused_loss:
                changes.append("train.fused_loss=true")
            if row["micro_batches"] != n_micro:
                changes.append(f"{row['micro_batches']} micro-batch per step")
            fits = (f"micro-batch {row['micro_batch']} (peak {row['peak_gb']} GB, "
                    f"train.global_batch_size={row['global_batch']})")
            if changes:
                fits += f" with {', '.join(changes)}"
            lines.append(f"  recompute={row['recompute']:<10} {fits}")
        if not any(r["micro_batch"] for r in rows):
            lines.append("  nothing fits one GPU, also not with train.fused_loss=true or one micro-batch per step: "
                         "shard the state (parallel.zero=1..3 over more data-parallel ranks) or the model "
                         "(parallel.tp / parallel.pp), or shorten train.seq_len")
        else:
            lines.append("  (a larger train.global_batch_size with the same micro-batch accumulates gradients: one "
                         "more set of gradients held, no more activations)")
    return "\n".join(lines)
