"""`megaloom doctor`: a pre-flight self-check of every rank before a job (run under torchrun).

Per rank: matmul throughput. Per group: all-reduce and all-gather bandwidth over the world, and point-to-point
between neighbours (the pattern of pipeline stages). Each rank's timings are gathered on rank 0 and compared
against the median of the other ranks (so that a world of two still has a reference); a rank slower than
`factor` x that median, or one whose test raised, is named, and the exit
code is non-zero so a job script can refuse to start on bad hardware (MegaScale's self-check).

The bandwidth tests run on device tensors over the world group (NCCL on GPUs); the table of timings and the
verdict travel over a gloo side group (parallel/host_group.py), as NCCL has no CPU backend. The medians of the
other ranks come from one sort per column (straggler.medians_of_others), so 8,192 ranks cost milliseconds.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from megaloom import accelerator
from megaloom.observe.heartbeat import node_name
from megaloom.observe.log import get_logger
from megaloom.parallel import comm
from megaloom.parallel.host_group import HostGroup
from megaloom.resilience.faults import FaultPlan
from megaloom.resilience.straggler import slower_than_others
from megaloom.resilience.suspects import record

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


def run_checks(device: torch.device, matmul_n: int, comm_mb: float, repeats: int, fault: FaultPlan,
               group=None) -> dict:
    """This rank's timings; the collectives run over ``group`` (default: the world) on ``device`` tensors."""
    group = dist.group.WORLD if group is None else group
    sync = lambda: accelerator.synchronize(device)  # noqa: E731  (nothing on CPU)
    dtype = torch.bfloat16 if accelerator.is_accelerator(device) else torch.float32
    a = torch.randn(matmul_n, matmul_n, device=device, dtype=dtype)
    b = torch.randn(matmul_n, matmul_n, device=device, dtype=dtype)
    extra = fault.slow_seconds()

    def mm():
        a @ b
        if extra:
            time.sleep(extra)

    results = {"matmul_s": _time(mm, repeats, sync)}
    results["matmul_tflops"] = 2 * matmul_n**3 / results["matmul_s"] / 1e12
    world, rank = comm.group_size(group), dist.get_rank()
    n = max(1, int(comm_mb * 1e6 / 4))
    x = torch.ones(n, device=device)
    results["all_reduce_s"] = _time(lambda: comm.all_reduce(x, group), repeats, sync)
    out = torch.empty(n * world, device=device)
    results["all_gather_s"] = _time(lambda: comm.all_gather_into(out, x, group), repeats, sync)
    peer = rank ^ 1 if (rank ^ 1) < world else rank
    buf = torch.empty_like(x)

    def p2p():
        if peer != rank:
            comm.send_recv([(x, peer)], [(buf, peer)], group)

    results["p2p_s"] = _time(p2p, repeats, sync)
    return results


def verdicts(table: np.ndarray, keys: list[str], factor: float) -> list[str]:
    """Per rank, from the gathered [world, len(keys) + 1] table (timings, then a failed flag): "FAILED", "SLOW:
    <keys>" (more than ``factor`` x the median of the other healthy ranks) or "ok". O(world log world)."""
    table = np.asarray(table, dtype=np.float64)
    failed = table[:, -1] != 0
    slow = np.stack([slower_than_others(table[:, i], factor, include=~failed) for i in range(len(keys))], axis=1)
    return ["FAILED" if failed[r] else (f"SLOW: {', '.join(k for k, s in zip(keys, slow[r], strict=True) if s)}"
                                        if slow[r].any() else "ok") for r in range(table.shape[0])]


def doctor(factor: float = 2.0, matmul_n: int = 512, comm_mb: float = 4.0, repeats: int = 5,
           group=None, run_dir: str | None = None) -> int:
    """Run under torchrun; returns the exit code (0 healthy, 1 a slow or failing rank).

    ``group``: the group whose collectives are timed (default: the world). The table and the verdict always
    travel over a gloo side group, whatever the world's backend. ``run_dir``: the nodes of unhealthy ranks are
    recorded there for the next restart to leave out (suspects.py, `megaloom evict`)."""
    device = accelerator.pick("auto", int(os.environ.get("LOCAL_RANK", 0)))  # the local rank's accelerator, or CPU
    started = not dist.is_initialized()
    if started:
        dist.init_process_group(accelerator.backend(device), timeout=timedelta(seconds=120))
    host = HostGroup(timeout_s=120)
    rank, world = dist.get_rank(), dist.get_world_size()
    keys = ["matmul_s", "all_reduce_s", "all_gather_s", "p2p_s"]
    try:
        res = run_checks(device, matmul_n, comm_mb, repeats, FaultPlan.from_env(rank), group)
        mine = [res[k] for k in keys] + [0.0]
    except Exception as e:  # a failing rank reports instead of hanging the others
        log.error(f"rank {rank}: self-check failed: {e!r}")
        mine = [0.0] * len(keys) + [1.0]
    table = host.all_gather_floats(mine).numpy()
    nodes = host.gather(node_name())  # rank 0: every rank's node (for the eviction record)
    code = 0
    if rank == 0:
        log.info(f"megaloom doctor: {world} ranks on {device.type}; slow = more than {factor:g}x the median time "
                 "of the other ranks")
        log.info(f"{'rank':>4}  " + "  ".join(f"{k:>14}" for k in keys) + "  verdict")
        bad: dict[int, str] = {}
        for r, (row, verdict) in enumerate(zip(table.tolist(), verdicts(table, keys, factor), strict=True)):
            if verdict != "ok":
                code = 1
                bad[r] = nodes[r]
            log.info(f"{r:>4}  " + "  ".join(f"{v * 1e3:>12.2f}ms" for v in row[:-1]) + f"  {verdict}")
        if run_dir and bad:
            record(run_dir, "doctor", 0, bad, f"factor {factor:g}")
            log.info(f"doctor: node(s) {sorted(set(bad.values()))} recorded in {run_dir} for eviction "
                     "(`megaloom evict`)")
        log.info("doctor: all ranks healthy" if code == 0 else "doctor: unhealthy ranks found (see above)")
    code = host.broadcast_int(code, src=0)
    if started:  # a caller's process group (tests) stays theirs
        dist.destroy_process_group()
    return code
