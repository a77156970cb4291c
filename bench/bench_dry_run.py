"""Dry runs at scale on one CPU machine: the process groups' construction time by world size, and one rank of a
large job built and stepped for real (`megaloom train --dry-run`, megaloom/training/dryrun.py).

    python bench/bench_dry_run.py mesh [--worlds 64 256 1024 4096] [overrides]   # Mesh.build on the fake group
    python bench/bench_dry_run.py run --world 1024 --rank last-stage --json OUT.json [--steps 1] [--memory-gb 16]
        [overrides]                                                                # one dry run (as the CLI)

`mesh` starts a fresh process per world size (a process group is process-wide) and times `Mesh.build` three times
there (median), with the number of process-group creation calls it makes: one per kind of group
(megaloom/parallel/groups.py: members-only groups, or one NCCL split of the world per kind), whatever the world;
only the layout arithmetic (every group's ranks, needed by the split) grows with the world, linearly.
`bench/dry_run_70b.sh` runs both parts for llama3-70b at tp 8 x pp 8 x dp 16.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

LAYOUT_70B = ["model.preset=llama3-70b", "parallel.tp=8", "parallel.pp=8", "train.micro_batch_size=1"]


def time_mesh(world: int, overrides: list[str], repeats: int = 3) -> dict:
    """In this process (no process group yet): the fake group of ``world`` ranks, rank 0; Mesh.build timed."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from megaloom.config import load_config
    from megaloom.parallel.mesh import Mesh, mesh_layout, validate_layout

    cfg = load_config(None, overrides)
    sizes = validate_layout(cfg, world)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    t0 = time.perf_counter()
    layout = mesh_layout(world, sizes)
    layout_s = time.perf_counter() - t0
    seconds, calls = [], 0
    for _ in range(repeats):
        mesh = Mesh.build(cfg, world, 0, "cpu")
        seconds.append(mesh.init_seconds)
        calls = mesh.group_calls
    dist.destroy_process_group()
    return {"world": world, "dp": sizes["dp"], "layout_s": layout_s, "build_s": statistics.median(seconds),
            "new_group_calls": calls, "groups_in_layout": sum(len(v) for v in layout.values()),
            "groups_of_rank": len(mesh.group_names())}


def mesh_table(worlds: list[int], overrides: list[str]) -> list[dict]:
    rows = []
    for w in worlds:
        gbs = max(1, w // 64) * 8  # a multiple of dp for every world of this layout
        over = [*overrides, f"train.global_batch_size={gbs}"]
        code = (f"import json, sys; sys.path.insert(0, {str(ROOT)!r}); from bench.bench_dry_run import time_mesh; "
                f"print('ROW' + json.dumps(time_mesh({w}, {over!r})))")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
        rows.append(json.loads(next(x for x in out.stdout.splitlines() if x.startswith("ROW"))[3:]))
    print("| world | dp | Mesh.build (median of 3) | group creation calls | per call | layout arithmetic | "
          "groups this rank is in |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['world']:,} | {r['dp']} | {r['build_s'] * 1e3:.1f} ms | {r['new_group_calls']:,} | "
              f"{r['build_s'] / r['new_group_calls'] * 1e6:.1f} us | {r['layout_s'] * 1e3:.1f} ms | "
              f"{r['groups_of_rank']} |")
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="part", required=True)
    m = sub.add_parser("mesh")
    m.add_argument("--worlds", type=int, nargs="+", default=[64, 256, 1024, 4096])
    m.add_argument("--json", default=None)
    m.add_argument("overrides", nargs="*")
    r = sub.add_parser("run")
    r.add_argument("--world", type=int, required=True)
    r.add_argument("--rank", default="0")
    r.add_argument("--steps", type=int, default=1)
    r.add_argument("--memory-gb", type=float, default=None)
    r.add_argument("--json", default=None)
    r.add_argument("--results", default=None, help="append one row (bench=dry_run) to this JSON-lines file")
    r.add_argument("--run-id", default=None)
    r.add_argument("--keep-dir", default=None, help="keep the run directory (the GPU profile's trace) here")
    r.add_argument("overrides", nargs="*")
    args = p.parse_args()
    if args.part == "mesh":
        rows = mesh_table(args.worlds, args.overrides or LAYOUT_70B)
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
        return 0
    from megaloom.config import load_config
    from megaloom.planning.memory_plan import GB
    from megaloom.training.dryrun import dry_run

    t0 = time.perf_counter()
    cfg = load_config(None, args.overrides)
    budget = int(args.memory_gb * GB) if args.memory_gb else None
    report = dry_run(cfg, args.world, args.rank, args.steps, budget, args.keep_dir)
    if report.plan is not None:
        print(report.plan.table())
    print(report.table())
    wall = time.perf_counter() - t0
    print(f"wall time {wall:.1f}s")
    if args.json:
        Path(args.json).write_text(json.dumps(report.as_dict(), indent=1, default=str) + "\n")
    row = result_row(cfg, report, args.overrides, args.run_id, wall)
    print("RESULT " + json.dumps(row), flush=True)
    if args.results:
        with open(args.results, "a") as f:
            f.write(json.dumps(row) + "\n")
    return 0


def layout_name(sizes: dict[str, int], cfg) -> str:
    """e.g. tp8-pp8-vpp2-dp16-sp (the sizes above 1, in mesh order)."""
    parts = [f"{k}{sizes[k]}" for k in ("tp", "cp", "ep", "pp") if sizes.get(k, 1) > 1]
    if cfg.parallel.vpp > 1:
        parts.append(f"vpp{cfg.parallel.vpp}")
    parts.append(f"dp{sizes['dp']}")
    if cfg.parallel.zero:
        parts.append(f"zero{cfg.parallel.zero}")
    if cfg.parallel.sp and sizes.get("tp", 1) > 1:
        parts.append("sp")
    return "-".join(parts)


def result_row(cfg, report, overrides: list[str], run_id: str | None, wall_s: float) -> dict:
    """One bench=dry_run row: the issue's columns (preset, world, layout, gpu, step_ms, kernel_ms, floor_ms,
    gpu_busy, mfu, peak_gb, plan_gb) and what identifies the run."""
    import datetime
    import subprocess

    import torch

    from megaloom.planning.memory_plan import GB

    prof = report.profile
    commit = os.environ.get("MEGALOOM_COMMIT") or subprocess.run(  # the GPU machine's copy has no .git
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    r2 = lambda v: round(v, 2) if v is not None else None  # noqa: E731
    return {
        "bench": "dry_run", "run_id": run_id, "date": datetime.date.today().isoformat(),
        "gpu": prof.get("gpu") or report.device, "torch": torch.__version__,
        "commit": commit or None, "preset": cfg.model.preset, "world": report.world,
        "shape": f"L{cfg.model.n_layers}-d{cfg.model.d_model}-h{cfg.model.n_heads}-ffn{cfg.model.ffn_dim}",
        "rank": report.rank, "stage": report.stage, "layout": layout_name(report.sizes, cfg),
        "seq_len": cfg.train.seq_len, "micro_batch": cfg.train.micro_batch_size,
        "global_batch": cfg.train.global_batch_size, "mode": report.mode,
        "step_ms": r2(prof.get("step_ms")), "kernel_ms": r2(prof.get("kernel_ms")), "busy_ms": r2(prof.get("busy_ms")),
        "floor_ms": r2(prof.get("floor_total_ms")), "gpu_busy": r2(prof.get("gpu_busy")) if prof else None,
        "step_vs_floor": r2(prof.get("step_vs_floor")), "mfu": round(prof["mfu"], 4) if "mfu" in prof else None,
        "mfu_step": round(prof["mfu_step"], 4) if "mfu_step" in prof else None,
        "fake_copy_ms": r2(prof.get("fake_copy_ms")),
        "kernels": prof.get("kernels"), "kinds_ms": {k: r2(v) for k, v in prof.get("kinds_ms", {}).items()},
        "floor_kinds_ms": {k: r2(v) for k, v in (prof.get("floor_ms") or {}).items()},
        "steps_s": [round(report.seconds[f"step_{i + 1}"], 3) for i in range(len(report.losses))],
        "peak_gb": r2(report.memory["step_peak"] / GB) if "step_peak" in report.memory else None,
        "plan_gb": r2(report.plan.peak / GB) if report.plan is not None else None,
        "build_peak_gb": r2(report.memory["build_peak"] / GB) if "build_peak" in report.memory else None,
        "plan_weights_gb": r2(report.plan.weights / GB) if report.plan is not None else None,
        "overrides": overrides, "wall_s": round(wall_s, 1), "levers": _levers(cfg, report.device),
    }


def _levers(cfg, device) -> dict:
    """The levers as this run chose them (explicit or auto), so a later check predicts the code that ran."""
    import dataclasses

    from megaloom.planning.levers import resolve_levers

    resolved, _ = resolve_levers(cfg, str(device).split(":")[0])
    keys = ("compile", "fused_loss", "attention", "bf16_residual", "grad_accum_fusion", "bf16_params")
    t = dataclasses.asdict(resolved.train)
    return {f"train.{k}": t[k] for k in keys if k in t}


if __name__ == "__main__":
    raise SystemExit(main())
