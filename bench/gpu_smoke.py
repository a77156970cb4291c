"""The GPU smoke suite: what every device call runs first (`bash bench/gpu_smoke.sh`, under 2 minutes).

One line per case, `SMOKE <case> PASS|FAIL <seconds> <what>`, then `SMOKE SUMMARY n passed, m failed`; exit 1 if
any failed. Cases (each chosen for a defect class that a CPU run did not catch, issue 46):

- dry runs at world 64 on the GPU (real kernels, compiled blocks where train.compile=auto compiles, the fake
  process group): a dense tp x pp x vpp layout, an MoE layout with ep 8 (Inductor once allocated a buffer of
  negative size from the fake group's split sizes), a context-parallel layout, and one fp8 step;
- a compiled tp=2 x dp=2 world of 4 processes (gloo, computing on CPU: one GPU cannot hold an NCCL world, and
  gloo carrying CUDA tensors segfaulted): tensor-parallel parity with one process, the blocks compiled
  (AOTAutograd), under the GPU machine's torch;
- the split-group tests of tests/parallel/test_gpu_world.py are run by gpu_smoke.sh (pytest).

    python bench/gpu_smoke.py [--only dense,moe,cp,fp8,world] [--device cuda|cpu]

On a CPU (``--device cpu``, models made small) it runs the same cases, which is how the script is tested before a
device call (tests/bench/test_gpu_smoke.py).
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.parallel (the world harness) when run as a script

WORLD = 64
# GPU sizes: real widths, few layers (every case is one compile and one step); CPU sizes: the tiny presets
DRY: dict[str, tuple[list[str], list[str] | None]] = {
    "dense": (["model.preset=llama3-1b", "model.n_layers=4", "parallel.tp=2", "parallel.pp=2", "parallel.vpp=2",
               "parallel.schedule=interleaved", "parallel.sp=true", "parallel.zero=1", "train.seq_len=2048",
               "train.global_batch_size=64"],
              ["model.preset=tiny", "parallel.tp=2", "parallel.pp=2", "parallel.vpp=2", "parallel.schedule=interleaved",
               "parallel.sp=true", "parallel.zero=1", "train.seq_len=64", "train.global_batch_size=64"]),
    "moe": (["model.preset=mixtral-8x7b", "model.n_layers=2", "parallel.ep=8", "parallel.zero=1",
             "train.seq_len=2048", "train.global_batch_size=64"],
            ["model.preset=mixtral-tiny", "parallel.ep=8", "parallel.zero=1", "train.seq_len=64",
             "train.global_batch_size=64"]),
    "cp": (["model.preset=llama3-1b", "model.n_layers=2", "parallel.cp=2", "parallel.tp=2", "parallel.sp=true",
            "train.seq_len=8192", "model.max_seq_len=8192", "train.global_batch_size=16"],
           ["model.preset=tiny", "parallel.cp=2", "parallel.tp=2", "parallel.sp=true", "train.seq_len=128",
            "train.global_batch_size=16"]),
    "fp8": (["model.preset=llama3-1b", "model.n_layers=2", "train.precision=fp8", "parallel.tp=2", "parallel.sp=true",
             "train.seq_len=2048", "train.global_batch_size=32"],
            None),  # fp8 needs an FP8-capable GPU: skipped on a CPU
}
COMMON = ["train.micro_batch_size=1"]


def dry_case(name: str, device: str) -> str:
    from megaloom.config import load_config
    from megaloom.training.dryrun import dry_run

    gpu, cpu = DRY[name]
    if device != "cuda" and cpu is None:
        return "SKIP (needs a GPU)"
    over = (gpu if device == "cuda" else cpu) + COMMON + [f"train.device={device}"]
    r = dry_run(load_config(None, over), WORLD, "0", steps=1)
    if not r.losses:
        raise RuntimeError(f"no step ran: {r.mode} ({r.why})")
    busy = r.profile.get("busy") if r.profile else None
    step = r.seconds.get("step_1", float("nan"))
    return (f"{over[0].split('=')[1]} world {WORLD}: step {step * 1e3:.0f} ms, loss {r.losses[0]:.3f}"
            + (f", GPU busy {busy:.0%}" if isinstance(busy, float) else ""))


def _world_suite(rank: int, world: int, device: torch.device) -> dict:
    from megaloom.parallel.mesh import Mesh
    from tests.parallel.worlds import parity_case, tiny_config

    mesh = Mesh.build(tiny_config(tp=2, world=world), world, rank, device)
    return {"parity": parity_case(mesh, "llama", True, steps=2, compiled=True), "dp": mesh.dp}


def world_case(device: str) -> str:
    from tests.parallel.checks import assert_parity
    from tests.parallel.harness import run_world

    # gloo on CPU, on the GPU machine too (its torch, its Inductor): one GPU cannot hold an NCCL world of 4, and gloo
    # carrying CUDA tensors of 4 ranks on one GPU died with SIGSEGV on the H100 (torch 2.11, 2026-12-06)
    backend, compute = "gloo", "cpu"
    results = run_world(4, _world_suite, backend=backend, timeout=150, compute=compute)
    for res in results:
        assert res["dp"] == 2, res["dp"]
        assert_parity(res["parity"])
    worst = max(abs(a - b) / abs(b) for res in results for a, b in zip(res["parity"]["loss"],
                                                                        res["parity"]["loss_ref"], strict=True))
    return f"tp2 x dp2 compiled, {backend} world on {compute}: parity with one process (loss rel err <= {worst:.1e})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="dense,moe,cp,fp8,world")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    print(f"SMOKE env: torch {torch.__version__}, "
          f"{torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU'}, device {args.device}",
          flush=True)
    passed = failed = 0
    for name in args.only.split(","):
        t0 = time.time()
        try:
            what = world_case(args.device) if name == "world" else dry_case(name, args.device)
            print(f"SMOKE {name} PASS {time.time() - t0:.1f}s {what}", flush=True)
            passed += 1
        except Exception as e:  # every case runs; the failures are named with their cause
            traceback.print_exc()
            print(f"SMOKE {name} FAIL {time.time() - t0:.1f}s {type(e).__name__}: {str(e)[:400]}", flush=True)
            failed += 1
    print(f"SMOKE SUMMARY {passed} passed, {failed} failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
