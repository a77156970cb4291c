"""A checkpoint save at world 8 on CPU (gloo): the sharded save (each rank writes its slices) beside the gathered
save it replaced (every rank gathers full tensors; DCP deduplicates the identical copies), and the memory each
costs a rank. Same model and state for both, in the same processes.

    python bench/bench_sharded_save.py [--world 8]

Model: 34M parameters (d 512, 8 layers, vocab 8192), tp=2 x dp=world/2 with ZeRO-1, AdamW state after one step.
"""

from __future__ import annotations

import argparse
import platform
import sys
import tempfile
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.checkpoint.sharded_worlds import save_load_peak  # noqa: E402
from tests.parallel.harness import run_world  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=8)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="megaloom-bench-save-") as root:
        results = run_world(args.world, save_load_peak, root, timeout=900)
    mib = 2**20
    print(f"{date.today()} {platform.machine()} ({platform.processor() or 'cpu'}), world {args.world} (gloo), "
          "tp=2 x dp=world/2, ZeRO-1, 34M params")
    print("| rank | holds (MiB) | sharded save s | +peak MiB | load +peak MiB | gathered save s | +peak MiB |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for rank, r in enumerate(results):
        print(f"| {rank} | {r['held'] / mib:.0f} | {r['save_s']:.2f} | {r['save'] / mib:.1f} | {r['load'] / mib:.1f} | "
              f"{r['gathered_s']:.2f} | {r['gathered'] / mib:.0f} |")
    assert all(r["same"] for r in results)


if __name__ == "__main__":
    main()
