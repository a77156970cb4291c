"""`megaloom plan`: the best layouts of a model on N GPUs of a kind, or the prediction of one given layout.

    megaloom plan model.preset=llama3-70b --gpus 1024 --gpu h100-sxm [train.seq_len=8192 ...] [--out plan.yaml]
    megaloom plan --predict run.yaml --gpus 1024 --gpu h200

The model, sequence length and global batch come from the config (overrides or ``--config``); the layout keys
(parallel.tp/cp/pp/vpp/ep/zero/sp/schedule, train.micro_batch_size/recompute/recompute_casts) are what the search
chooses. ``--out`` writes the best layout into the config as given, a file `megaloom train --config` runs
unchanged.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from megaloom.config import Config, ConfigError, load_config
from megaloom.planning.hardware import GpuKind, load_gpu, with_cluster
from megaloom.planning.memory_fit import resolve_for_planning
from megaloom.planning.search import Option, fit_memory, search
from megaloom.planning.shape import shaped
from megaloom.planning.step import Prediction, predict


def _row(i: int, cfg: Config, p: Prediction) -> str:
    s, par, t = p.sizes, cfg.parallel, cfg.train
    lean = "+lean" if t.recompute_casts is True else ""
    exposed = " ".join(f"{k}:{1e3 * v:.0f}" for k, v in sorted(p.exposed.items())) or "-"
    bubble = 100 * p.bubble_s / p.step_s if p.step_s else 0.0
    # the end pipeline ranks' layer counts where the layers do not divide (parallel.pp_first/last_stage_layers)
    ends = (f"{par.pp_first_stage_layers or '-'}/{par.pp_last_stage_layers or '-'}"
            if par.pp_first_stage_layers or par.pp_last_stage_layers else "-")
    return (f"{i:>3} {s['tp']:>3} {s['cp']:>3} {s['pp']:>3} {par.vpp:>3} {ends:>5} {s['dp']:>5} {s['ep']:>3} "
            f"{par.zero:>4} {t.micro_batch_size:>3} {t.recompute + lean:<15} {p.memory_gb:>7.1f} {p.step_s:>8.3f} "
            f"{p.tokens_per_s:>12,.0f} {100 * p.mfu:>6.1f}% {bubble:>6.1f}%  {exposed}")


HEADER = (f"{'#':>3} {'tp':>3} {'cp':>3} {'pp':>3} {'vpp':>3} {'ends':>5} {'dp':>5} {'ep':>3} {'zero':>4} {'mb':>3} "
          f"{'recompute':<15} {'mem GB':>7} {'step s':>8} {'tokens/s':>12} {'MFU':>7} {'bubble':>7}  exposed ms")


def layout_config(user: Config, chosen: Config) -> Config:
    """The user's config with the chosen layout's keys (nothing else: the vocabulary stays as the user set it)."""
    p = dataclasses.replace(user.parallel, **{k: getattr(chosen.parallel, k) for k in (
        "tp", "cp", "pp", "vpp", "ep", "zero", "sp", "schedule", "pp_first_stage_layers", "pp_last_stage_layers")})
    t = dataclasses.replace(user.train, **{k: getattr(chosen.train, k) for k in (
        "micro_batch_size", "recompute", "recompute_layers", "recompute_casts")})
    return dataclasses.replace(user, parallel=p, train=t)


def describe(p: Prediction, cfg: Config, gpu: GpuKind) -> str:
    lines = [f"{p.gpu} ({gpu.source} calibration), {p.world:,} GPUs, {gpu.gpus_per_node} a node, "
             f"NIC {gpu.nic_gbps:g} GB/s per GPU; {p.n_micro} micro-batches a step per pipeline",
             HEADER, _row(1, cfg, p),
             f"step {p.step_s:.3f} s = pipeline {p.step_s - p.optimizer_s - p.exposed.get('dp', 0.0):.3f} s (compute "
             f"{p.compute_s:.3f} s, bubble {p.bubble_s:.3f} s, exposed tp/cp/ep/pp inside it) + data-parallel "
             f"reduction not hidden {p.exposed.get('dp', 0.0):.3f} s + optimizer {p.optimizer_s:.3f} s",
             f"memory: {p.memory_gb:.1f} GB planned at the {p.memory_phase} of pipeline stage {p.memory_stage} "
             f"({'fits' if p.fits else 'does NOT fit'} 95% of {gpu.memory_gb:g} GB)"]
    return "\n".join(lines)


def plan_command(cfg: Config, gpus: int, gpu_kind: str, top: int = 10, out: str | None = None,
                 predict_config: str | None = None, gpus_per_node: int | None = None,
                 nic_gbps: float | None = None, json_out: str | None = None) -> str:
    if gpus < 1:
        raise ConfigError(f"--gpus {gpus}: give the number of GPUs of the job (>= 1).")
    gpu = with_cluster(load_gpu(gpu_kind), gpus_per_node, nic_gbps)
    if predict_config:
        given = load_config(predict_config, [])
        resolved = resolve_for_planning(given)
        fitted = fit_memory(resolved, gpus, gpu)
        chosen = fitted[0] if fitted else resolved
        pred = predict(chosen, gpus, gpu)
        if json_out:
            Path(json_out).write_text(json.dumps(dataclasses.asdict(pred), indent=1) + "\n")
        return describe(pred, chosen, gpu)
    options, counts = search(shaped(cfg), gpus, gpu, top)
    lines = [f"{cfg.model.preset or cfg.model.arch} on {gpus:,} x {gpu.name} ({gpu.source} calibration; "
             f"{gpu.gpus_per_node} a node, NIC {gpu.nic_gbps:g} GB/s per GPU), seq {cfg.train.seq_len}, global "
             f"batch {cfg.train.global_batch_size}: {counts['candidates']} layouts, {counts['refused']} refused by the "
             f"config rules, {counts['do not fit']} do not fit 95% of {gpu.memory_gb:g} GB"]
    if not options:
        lines.append("no layout fits: more GPUs, a smaller train.global_batch_size per GPU, or a shorter sequence")
        return "\n".join(lines)
    lines.append(HEADER)
    lines += [_row(i + 1, o.cfg, o.prediction) for i, o in enumerate(options)]
    best: Option = options[0]
    if out:
        Path(out).write_text(layout_config(cfg, best.cfg).to_yaml())
        lines.append(f"the best layout written to {out}: megaloom train --config {out}")
    if json_out:
        Path(json_out).write_text(json.dumps([dataclasses.asdict(o.prediction) for o in options], indent=1) + "\n")
    return "\n".join(lines)
