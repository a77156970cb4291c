"""Process-level set-up: device choice, torch.distributed initialisation under torchrun, seeding."""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megaloom import accelerator
from megaloom.accelerator import compute_precision
from megaloom.config import Config, ConfigError
from megaloom.observe.log import get_logger
from megaloom.parallel.mesh import init_timeout
from megaloom.resilience import flight_recorder

log = get_logger(__name__)


@dataclass
class Runtime:
    device: torch.device
    rank: int
    world_size: int
    local_rank: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def pick_device(choice: str, local_rank: int) -> torch.device:
    """``train.device`` for this rank, made current (`accelerator.pick`: refused, naming the fix, where this machine
    has no such device)."""
    return accelerator.pick(choice, local_rank)


def init_runtime(cfg: Config) -> Runtime:
    """Read torchrun's environment; start the process group (the device type's backend: NCCL on CUDA GPUs, gloo on
    CPUs) when world > 1."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = pick_device(cfg.train.device, local_rank)
    if world > 1 and not dist.is_initialized():
        # Before the process group exists: torch reads the flight recorder's settings once (resilience doc).
        flight_recorder.configure(cfg.run.dir)
        start_process_group(device, rank, world, init_timeout(cfg), store=_attempt_store(rank, world))
    return Runtime(device=device, rank=rank, world_size=world, local_rank=local_rank)


def start_process_group(device: torch.device, rank: int, world: int, timeout: timedelta, *,
                        store: dist.Store | None = None, init_method: str | None = None, backend: str | None = None,
                        bind: torch.device | None = None) -> None:
    """The one way megaloom starts torch.distributed (`init_runtime`; the test worlds, tests/parallel/harness.py,
    call it too, so they take the same path): torch's default backend for the device's type (`accelerator.backend`:
    NCCL on a CUDA device, XCCL on XPU, gloo on CPU; ``backend`` overrides), and
    the device bound to the default group (``device_id``) when it is an accelerator. The binding is what lets
    `Mesh.build` split communicators (`parallel.groups.can_split`); torch refuses to bind a CPU device, so a gloo
    world on CPU makes its groups with ``new_group``. ``bind``: the device to bind when it is not ``device`` (a
    test binding a gloo world to the one GPU of its host)."""
    bind = bind if bind is not None else device
    dist.init_process_group(backend or accelerator.backend(device), init_method=init_method,
                            store=store, rank=rank, world_size=world,
                            device_id=bind if bind.type != "cpu" else None, timeout=timeout)


def collective_timeout(cfg: Config) -> timedelta:
    """Every training process group's timeout after step 1 (`resilience.collective_timeout_s`, above the
    watchdog's; `shorten_timeouts`). Until then they run under `init_timeout`, given to init_process_group and to
    each group megaloom creates, which would otherwise take torch's default (10 min on NCCL)."""
    return timedelta(seconds=cfg.resilience.collective_timeout_s)


def set_group_timeout(group: Any, timeout: timedelta) -> bool:
    """Change a process group's collective timeout after creation (torch's private ``_set_pg_timeout``, what
    TorchTitan calls; it sets the NCCL and gloo backends' default timeout). False, with the group unchanged, where
    this torch lacks it."""
    from torch.distributed import distributed_c10d

    set_timeout = getattr(distributed_c10d, "_set_pg_timeout", None)
    if set_timeout is None:
        return False
    set_timeout(timeout, group)
    return True


def shorten_timeouts(groups: list[Any], timeout: timedelta, host_barrier: Callable[[], None],
                     device: torch.device) -> None:
    """After the first step: every rank's training groups (and the world) take ``timeout``. The work queued on
    the device is finished and every rank has arrived (``host_barrier``, a gloo group's) first, so that no rank
    still inside step 1, legitimately slow under the long timeout, meets a peer's shortened one (TorchTitan's
    order)."""
    accelerator.synchronize(device)
    host_barrier()
    seen: set[int] = set()
    for g in [dist.group.WORLD, *groups]:
        if g is not None and id(g) not in seen:
            seen.add(id(g))
            if not set_group_timeout(g, timeout):
                log.warning("WARNING: this torch cannot change a process group's timeout after creation "
                            "(torch.distributed.distributed_c10d._set_pg_timeout): the training groups keep the "
                            "start-up timeout (resilience.init_timeout_s); set it to resilience.collective_timeout_s "
                            "to train under that one.")
                return


def init_fake_runtime(cfg: Config, world_size: int, rank: int) -> Runtime:
    """One rank of a ``world_size``-process job, alone in this process: torch's fake process group, whose
    collectives return at once and leave every tensor as it is (a dry run, megaloom/training/dryrun.py; the same
    tool TorchTitan's dry runs use). Groups, shapes and memory are real; the numbers that cross ranks are not."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    if dist.is_initialized():
        raise RuntimeError("init_fake_runtime: a process group is already initialised in this process.")
    device = pick_device(cfg.train.device, 0)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    return Runtime(device=device, rank=rank, world_size=world_size, local_rank=0)


def _attempt_store(rank: int, world: int) -> dist.Store:
    """The rendezvous store, with keys prefixed by torchrun's restart count.

    torchrun's agent keeps one store across restarts; without a per-attempt prefix, a restarted worker can read
    a peer's address published by the previous attempt and fail to connect (seen with gloo subgroups).
    """
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                         is_master=(rank == 0 and not agent), timeout=timedelta(minutes=10),
                         multi_tenant=not agent)
    return dist.PrefixStore(f"megaloom/attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", base)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def resolve_precision(cfg: Config, device: torch.device) -> str:
    """train.precision for this device (`accelerator.compute_precision`'s rule), refusing what the device cannot run."""
    p = compute_precision(cfg, device)
    if cfg.train.precision == "auto":
        if p == "fp32" and cfg.train.bf16_residual is True:
            raise ConfigError("train.bf16_residual=true: precision auto is fp32 on this device (no autocast); set "
                              "train.precision=bf16 or train.bf16_residual=false.")
        return p
    if p == "fp8":
        capability = accelerator.cuda_capability(device)
        if capability is None or capability < (8, 9):
            raise ConfigError("train.precision=fp8 needs an FP8-capable NVIDIA GPU (Hopper/Ada, compute capability "
                              ">= 8.9); this device has none. Use bf16.")
    return p
