"""Run a function on every rank of a freshly spawned process group and collect what each rank returns.

Spawning costs seconds (each process imports torch), so tests start a world once and run many cases in
it. The backend follows the hardware: NCCL with one GPU per rank when there are enough GPUs, gloo on CPU
otherwise, so the same test code exercises the production path on a GPU host.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megaloom.runtime import pick_device, start_process_group


def pick_backend(world_size: int) -> str:
    return "nccl" if torch.cuda.device_count() >= world_size else "gloo"


def _entry(rank: int, world_size: int, backend: str, tmp: str, fn: Callable, args: tuple, bind: str | None,
           compute: str | None = None) -> None:
    torch.set_num_threads(1)  # several ranks share two cores: avoid oversubscription
    # The production start-up (runtime.init_runtime's order): pick and set the device, then start the default
    # group through runtime.start_process_group, which binds an accelerator to it, so that Mesh.build splits
    # communicators (dist.split_group) where torch allows it and makes new groups where it does not.
    device = pick_device(compute or (f"cuda:{rank}" if backend == "nccl" else "cpu"), rank)
    start_process_group(device, rank, world_size, timedelta(seconds=120), init_method=f"file://{tmp}/init",
                        backend=backend, bind=torch.device(bind) if bind else None)
    try:
        result = fn(rank, world_size, device, *args)
        torch.save(result, os.path.join(tmp, f"result{rank}.pt"))
        # Every rank done before any tears down: gloo aborts a process ("terminate called without an active
        # exception", seen once in CI) when a peer closes its connections while it still has traffic in flight.
        # A world without a CPU backend ("cuda:gloo" on a CPU host) meets on a gloo group instead.
        dist.barrier(group=dist.new_group(backend="gloo") if backend.startswith("cuda:") else None)
    finally:
        dist.destroy_process_group()


def run_world(world_size: int, fn: Callable, *args: Any, timeout: float = 240.0, backend: str | None = None,
              bind: str | None = None, compute: str | None = None) -> list[Any]:
    """``fn(rank, world_size, device, *args)`` on ``world_size`` processes; returns the results by rank.

    ``backend`` overrides the choice by hardware, e.g. "cuda:gloo": a CPU world whose default group has no CPU
    backend, as an NCCL world has none (host-side collectives must then use a group of their own). ``bind``: a
    device to bind to the default group other than the ranks' own (e.g. "cuda:0" for a gloo world on a host with
    one GPU: the ranks compute on CPU and the groups are split from the bound world, as in an NCCL job).
    ``compute``: the ranks' device when it is not the backend's choice (e.g. "cuda:0" for every rank of a
    "cuda:gloo" world on a host with one GPU: gloo moves the CUDA tensors through the host).

    ``fn`` must be importable (module level). A worker's exception is re-raised here with its traceback
    (torch.multiprocessing stops the other ranks); a world that outlives ``timeout`` is terminated.
    """
    tmp = tempfile.mkdtemp(prefix="megaloom-world-")
    try:
        ctx = mp.spawn(_entry, args=(world_size, backend or pick_backend(world_size), tmp, fn, args, bind, compute),
                       nprocs=world_size, join=False)
        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.terminate()
                raise TimeoutError(f"world of {world_size} running {fn.__name__} exceeded {timeout:.0f}s")
        return [torch.load(Path(tmp) / f"result{r}.pt", weights_only=False) for r in range(world_size)]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
