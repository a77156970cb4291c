"""What a DTensor costs per op compared with megaloom's plain tensors + `Layout` (the evidence behind
parallel/layout.py's choice).

One process, a one-rank gloo group, so no communication happens on either path: what is left is the
per-op work that DTensor's dispatch (placement propagation, local/global wrapping) adds to a forward +
backward of a small column-parallel linear layer, the shape of the ops a transformer step issues by the
hundreds. Prints microseconds per forward+backward for both and the difference.

    python bench/bench_layout.py [--iters 2000] [--dim 64]
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from datetime import date

import torch
import torch.distributed as dist
import torch.nn.functional as F


def _time(fn, iters: int) -> float:
    for _ in range(20):
        fn()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--dim", type=int, default=64)
    args = ap.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=0, world_size=1)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    d = args.dim
    w = torch.randn(d, d, requires_grad=True)
    x = torch.randn(8, d, requires_grad=True)
    wd = distribute_tensor(w.detach(), mesh, [Shard(0)]).requires_grad_()
    xd = distribute_tensor(x.detach(), mesh, [Replicate()]).requires_grad_()

    def plain() -> None:
        F.linear(x, w).sum().backward()

    def dtensor() -> None:
        F.linear(xd, wd).sum().backward()

    torch.set_num_threads(1)
    t_plain, t_dt = _time(plain, args.iters), _time(dtensor, args.iters)
    print(f"{date.today()} {platform.processor() or platform.machine()} torch {torch.__version__}, "
          f"linear [8,{d}]x[{d},{d}] forward+backward, one rank:")
    print(f"  plain tensors + Layout: {t_plain:8.1f} us")
    print(f"  DTensor (Shard(0) weight, Replicate input): {t_dt:8.1f} us  (+{t_dt - t_plain:.1f} us per op pair)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
