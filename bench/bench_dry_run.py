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
    r.add_argument("overrides", nargs="*")
    args = p.parse_args()
    if args.part == "mesh":
        rows = mesh_table(args.worlds, args.overrides or LAYOUT_70B)
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
        return 0
    from megaloom.config import load_config
    from megaloom.training.dryrun import main_dry_run

    t0 = time.perf_counter()
    rc = main_dry_run(load_config(None, args.overrides), args.world, args.rank, args.steps, args.memory_gb,
                      args.json, None)
    print(f"wall time {time.perf_counter() - t0:.1f}s")
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
