"""Kernel time by kind from a saved profiler trace (the library is megaloom/observe/profile.py).

    python bench/profile_breakdown.py TRACE.json.gz [--moe] [--step-ms MS] [--top N]

re-reads a saved trace and prints the table and each kind's largest kernels. `bench_train.py --profile` and
`megaloom train --dry-run` (on a GPU) write such traces.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from megaloom.observe.profile import (  # noqa: E402,F401  (re-exported for bench_train.py and the tests)
    KINDS,
    MOE_KINDS,
    breakdown,
    floor_ms,
    kind_of,
    profile_step,
    table,
    top_kernels,
)


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description="kernel time by kind from a saved profiler trace")
    ap.add_argument("trace")
    ap.add_argument("--moe", action="store_true", help="split out the MoE kinds (grouped GEMM, routing, dispatch)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--step-ms", type=float, default=None, help="the unprofiled step time, for the shares")
    ap.add_argument("--top", type=int, default=3, help="largest kernels listed per kind")
    ap.add_argument("--fake-group", action="store_true",
                    help="a dry run's trace: the device copies launched inside collectives as their own kind")
    args = ap.parse_args(argv)
    b = breakdown(Path(args.trace), args.device, args.moe, args.fake_group)
    print(table(b, args.step_ms))
    for kind, rows in top_kernels(Path(args.trace), args.device, args.moe, args.top).items():
        print(f"\n{kind}:")
        for ms, calls, name in rows:
            print(f"  {ms:9.2f} ms  {calls:5d}x  {name[:140]}")


if __name__ == "__main__":
    main()
