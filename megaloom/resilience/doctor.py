"""`megaloom doctor`: a pre-flight self-check of every rank before a job (run under torchrun).

Per rank: matmul throughput. Per group: all-reduce and all-gather bandwidth over the world, and point-to-point
between neighbours (the pattern of pipeline stages). Each rank's timings are gathered on rank 0 and compared
against the median of the other ranks (so that a world of two still has a reference); a rank slower than
`factor` x that median, or one whose test raised, is named, and the exit
code is non-zero so a job script can refuse to start on bad hardware (MegaScale's self-check).
"""

from __future__ import annotations

import os
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from megaloom.observe.log import get_logger
from megaloom.parallel import comm
from megaloom.resilience.faults import FaultPlan

log = get_logger(__name__)


def _time(fn, repeats: int, sync) -> float:
    fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return min(times)  # other processes' load only ever adds time: the fastest repeat is the device's speed


def run_checks(device: torch.device, matmul_n: int, comm_mb: float, repeats: int, fault: FaultPlan) -> dict:
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(matmul_n, matmul_n, device=device, dtype=dtype)
    b = torch.randn(matmul_n, matmul_n, device=device, dtype=dtype)
    extra = fault.slow_seconds()

    def mm():
        a @ b
        if extra:
            time.sleep(extra)

    results = {"matmul_s": _time(mm, repeats, sync)}
    results["matmul_tflops"] = 2 * matmul_n**3 / results["matmul_s"] / 1e12
    world, rank = dist.get_world_size(), dist.get_rank()
    n = max(1, int(comm_mb * 1e6 / 4))
    x = torch.ones(n, device=device)
    results["all_reduce_s"] = _time(lambda: comm.all_reduce(x, dist.group.WORLD), repeats, sync)
    out = torch.empty(n * world, device=device)
    results["all_gather_s"] = _time(lambda: comm.all_gather_into(out, x, dist.group.WORLD), repeats, sync)
    peer = rank ^ 1 if (rank ^ 1) < world else rank
    buf = torch.empty_like(x)

    def p2p():
        if peer != rank:
            comm.send_recv([(x, peer)], [(buf, peer)], dist.group.WORLD)

    results["p2p_s"] = _time(p2p, repeats, sync)
    return results


def doctor(factor: float = 2.0, matmul_n: int = 512, comm_mb: float = 4.0, repeats: int = 5) -> int:
    """Run under torchrun; returns the exit code (0 healthy, 1 a slow or failing rank)."""
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    keys = ["matmul_s", "all_reduce_s", "all_gather_s", "p2p_s"]
    try:
        res = run_checks(device, matmul_n, comm_mb, repeats, FaultPlan.from_env(rank))
        mine = torch.tensor([res[k] for k in keys] + [0.0], dtype=torch.float64)
    except Exception as e:  # a failing rank reports instead of hanging the others
        log.error(f"rank {rank}: self-check failed: {e!r}")
        mine = torch.tensor([0.0] * len(keys) + [1.0], dtype=torch.float64)
    table = torch.zeros(world * (len(keys) + 1), dtype=torch.float64)
    comm.all_gather_into(table, mine, dist.group.WORLD)
    rows = table.view(world, len(keys) + 1).tolist()
    code = 0
    if rank == 0:
        log.info(f"megaloom doctor: {world} ranks on {device.type}; slow = more than {factor:g}x the median time "
                 "of the other ranks")
        log.info(f"{'rank':>4}  " + "  ".join(f"{k:>14}" for k in keys) + "  verdict")
        for r, row in enumerate(rows):
            others = [o for j, o in enumerate(rows) if j != r and not o[-1]]
            medians = [statistics.median(o[i] for o in others) if others else 0.0 for i in range(len(keys))]
            bad = [k for i, k in enumerate(keys) if medians[i] > 0 and row[i] > factor * medians[i]]
            verdict = "FAILED" if row[-1] else (f"SLOW: {', '.join(bad)}" if bad else "ok")
            if verdict != "ok":
                code = 1
            log.info(f"{r:>4}  " + "  ".join(f"{v * 1e3:>12.2f}ms" for v in row[:-1]) + f"  {verdict}")
        log.info("doctor: all ranks healthy" if code == 0 else "doctor: unhealthy ranks found (see above)")
    flag = torch.tensor([float(code)])
    comm.broadcast(flag, 0, dist.group.WORLD)
    dist.destroy_process_group()
    return int(flag.item())
