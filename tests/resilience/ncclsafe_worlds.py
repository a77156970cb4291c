"""Rank functions of the NCCL-safety tests (module level, so spawned processes can import them).

`host_side_cases` runs in a world whose default group has no CPU backend (CPU: "cuda:gloo"; GPU: NCCL), the
class of world in which a CPU tensor sent over the world group raises "No backend type associated with device
type cpu". `runtime_then_hang` starts a world the way `megaloom train` does (torchrun's environment,
`init_runtime`), checks the timeouts every group got, then hangs one rank with MEGALOOM_FAULT so that the
watchdogs fire (the processes end with the watchdog's exit code 3).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

SLOW_RANK_SECONDS = 0.5


def _cpu_collective_on_world_fails() -> str:
    try:
        dist.all_reduce(torch.ones(1), group=dist.group.WORLD)
    except Exception as e:  # noqa: BLE001 -- the message is the result
        return str(e)
    return ""


def _timeout_s(group, device: str = "cpu") -> float:
    return group._get_backend(torch.device(device)).options._timeout.total_seconds()


class SimulatedDevice:
    """A device clock (ms) with events in the shape of torch.cuda.Event: what a GPU would time, on CPU. An event
    has finished once the clock moved past it."""

    def __init__(self) -> None:
        self.now = 0.0

    def event(self):
        device = self

        class Event:
            def record(self) -> None:
                self.t = device.now

            def query(self) -> bool:
                return device.now > self.t

            def synchronize(self) -> None:
                device.now = max(device.now, self.t + 1e-9)

            def elapsed_time(self, later) -> float:
                return later.t - self.t

        return Event()


def device_straggler_case(rank: int, world: int, control) -> dict:
    """GPU timing on a simulated device: the last rank's device computes 5x longer per step, the others wait
    for it inside the gradient all-reduce; every host returns from each step at once (NCCL enqueues). Device
    spans name the slow rank; the host's clock, fed the same steps, sees equal ranks."""
    from megaloom.parallel.comm import LastOpRecorder
    from megaloom.resilience.straggler import DeviceSpans, StragglerDetector

    dev = SimulatedDevice()
    rec = LastOpRecorder()
    on_device = StragglerDetector(world, 1.5, rec, control, DeviceSpans(dev.event))
    on_host = StragglerDetector(world, 1.5, LastOpRecorder(), control)
    slow = rank == world - 1
    for _ in range(3):
        on_device.start_step()
        on_host.start_step()
        dev.now += 50.0 if slow else 10.0  # forward and backward kernels
        rec.enter("all_reduce_sum", None)  # the stream waits here for the slowest peer
        dev.now += 0.0 if slow else 40.0
        rec.exit()
        dev.now += 2.0  # the optimizer step
        on_device.end_step(0.001)
        on_host.end_step(0.001)  # the host only enqueued
    res: dict = {}
    res["device_stragglers"], res["device_times"] = on_device.check()
    res["host_stragglers"], _ = on_host.check()
    return res


def start_up_and_checkpoint_cases(rank: int, world: int, root: str) -> dict:
    """The data-cache build's barriers and a blocking DCP save + load, as the trainer runs them, in a world whose
    default group has no CPU backend: they must travel over the host-side (gloo) checkpoint group."""
    from megaloom.checkpoint.group import CheckpointGroup
    from megaloom.checkpoint.store import load_checkpoint, save_checkpoint
    from megaloom.runtime import Runtime
    from megaloom.training.data import load_rank_datasets

    host = CheckpointGroup(61)
    res: dict = {"host_timeout_s": _timeout_s(host.group)}
    built = []
    rt = Runtime(device=torch.device("cpu"), rank=rank, world_size=world, local_rank=rank)
    out = load_rank_datasets(None, None, 8, 0, 4, 2, rt, True, host=host,
                             default=lambda *a, **k: built.append(rank) or ("train", "valid", "tok"))
    res["datasets"], res["built"] = out, built
    torch.manual_seed(0)  # every rank the same weights: a replicated model, written once
    model = torch.nn.Linear(4, 3)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    path = save_checkpoint(Path(root) / "ckpt", 1, model, None, {"step": 1}, keep=2, group=host)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    load_checkpoint(path, model, None, rank=rank, group=host)
    res["restored"] = all(torch.equal(v, want[k]) for k, v in model.state_dict().items())
    return res


def host_side_cases(rank: int, world: int, device: torch.device, comm_group_gloo: bool, root: str) -> dict:
    from megaloom.parallel.comm import LastOpRecorder
    from megaloom.parallel.host_group import HostGroup
    from megaloom.resilience.doctor import doctor
    from megaloom.resilience.straggler import StragglerDetector

    res: dict = {"world_cpu_error": _cpu_collective_on_world_fails()}
    control = HostGroup(timeout_s=77)
    res["control_timeout_s"] = _timeout_s(control.group)
    det = StragglerDetector(world, 1.5, LastOpRecorder(), control)
    for _ in range(2):  # the last rank computes SLOW_RANK_SECONDS per step, the others a tenth of it
        det.start_step()
        det.end_step(SLOW_RANK_SECONDS if rank == world - 1 else SLOW_RANK_SECONDS / 10)
    res["stragglers"], res["times"] = det.check()
    res.update(device_straggler_case(rank, world, control))
    # The doctor's bandwidth tests run on device tensors over `group`: on a GPU host the NCCL world; here a gloo
    # group stands in for it (gloo_comm=True), or the world itself, whose collectives on CPU tensors fail on
    # every rank: the table and the verdict must still travel (all FAILED, exit code 1), not raise.
    group = dist.new_group(backend="gloo") if comm_group_gloo else None
    res["doctor_code"] = doctor(factor=50.0, matmul_n=32, comm_mb=0.01, repeats=1, group=group)
    res["doctor_failed_code"] = doctor(factor=50.0, matmul_n=32, comm_mb=0.01, repeats=1)
    res.update(start_up_and_checkpoint_cases(rank, world, root))
    return res


def _set_torchrun_env(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), TORCHELASTIC_RESTART_COUNT="0")


def runtime_then_hang(rank: int, world: int, port: int, out: str, overrides: list[str], fault: str) -> None:
    """A training world's start-up (init_runtime, Mesh.build, the loop's Resilience), its timeouts saved to
    out/rank<N>.pt, then two steps where rank 1 hangs in step 2 (MEGALOOM_FAULT) and the others block in a
    collective: every watchdog fires and ends its process with exit code 3."""
    torch.set_num_threads(1)
    _set_torchrun_env(rank, world, port)
    os.environ["MEGALOOM_FAULT"] = fault
    for key in ("TORCH_FR_BUFFER_SIZE", "TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_TRACE_BUFFER_SIZE",
                "TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_NCCL_ASYNC_ERROR_HANDLING"):
        os.environ.pop(key, None)
    from megaloom.checkpoint.group import CheckpointGroup
    from megaloom.config import load_config
    from megaloom.parallel import comm
    from megaloom.parallel.mesh import Mesh
    from megaloom.parallel.pipeline.stage import build_embedding_groups
    from megaloom.resilience.guard import Resilience
    from megaloom.runtime import collective_timeout, init_runtime, shorten_timeouts

    cfg = load_config(None, overrides)
    rt = init_runtime(cfg)
    mesh = Mesh.build(cfg, rt.world_size, rt.rank, rt.device)
    emb = build_embedding_groups(mesh)
    guard = Resilience(cfg, Path(cfg.run.dir), rt.rank, rt.world_size, mesh)
    ckpt = CheckpointGroup(cfg.checkpoint.timeout_s)
    timeouts = {"world": _timeout_s(dist.group.WORLD), "pp": _timeout_s(mesh.pp_group),
                "embedding": _timeout_s(emb), "control": _timeout_s(guard.straggler.group.group),
                "checkpoint": _timeout_s(ckpt.group)}
    env = {k: os.environ.get(k) for k in ("TORCH_FR_BUFFER_SIZE", "TORCH_FR_DUMP_TEMP_FILE",
                                          "TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_NCCL_ASYNC_ERROR_HANDLING")}
    model = torch.nn.Linear(2, 2)
    x = torch.ones(4)
    for step in (1, 2):
        guard.before_step(step, model)  # rank 1 sleeps in step 2: a hung device, as the watchdog sees it
        t0 = time.perf_counter()
        comm.all_reduce(x, mesh.pp_group, recorder=mesh.recorder)  # the others wait here for rank 1
        guard.after_step(step, False, time.perf_counter() - t0)
        if step == 1:  # what the trainer does after its first step: the start-up timeout ends
            shorten_timeouts(mesh.training_groups(), collective_timeout(cfg), ckpt.barrier, rt.device)
            after = {"world": _timeout_s(dist.group.WORLD), "pp": _timeout_s(mesh.pp_group),
                     "embedding": _timeout_s(emb), "checkpoint": _timeout_s(ckpt.group)}
            torch.save({"timeouts": timeouts, "after_step1": after, "env": env}, Path(out) / f"rank{rank}.pt")
    time.sleep(120)  # not reached: the watchdog ends the process first


# ------------------------------------------------------------------------------------------- GPU (NCCL) worlds


def gpu_host_side_cases(rank: int, world: int, device: torch.device) -> dict:
    """In an NCCL world (one GPU per rank): the straggler check and the whole doctor, whose bandwidth tests run on
    the GPU over NCCL while their table and verdict go over the gloo side group."""
    from megaloom.parallel.comm import LastOpRecorder
    from megaloom.parallel.host_group import HostGroup
    from megaloom.resilience.doctor import doctor
    from megaloom.resilience.straggler import StragglerDetector

    res: dict = {"world_backend": dist.get_backend(), "world_cpu_error": _cpu_collective_on_world_fails()}
    control = HostGroup(timeout_s=77)
    res["control_backend"] = dist.get_backend(control.group)
    det = StragglerDetector(world, 1.5, LastOpRecorder(), control)
    det.start_step()
    det.end_step(SLOW_RANK_SECONDS if rank == world - 1 and world > 1 else SLOW_RANK_SECONDS / 10)
    res["stragglers"], res["times"] = det.check()
    os.environ["LOCAL_RANK"] = str(rank)  # the doctor picks its GPU as under torchrun
    res["doctor_code"] = doctor(factor=50.0, matmul_n=1024, comm_mb=4.0, repeats=3)
    return res


def gpu_slow_rank_case(rank: int, world: int, device: torch.device) -> dict:
    """Two processes on the one GPU (a gloo world: NCCL refuses two ranks on one GPU): every step each enqueues
    the same number of matmuls, the last rank's 64x larger, then they meet in a gloo all-reduce (the host-side
    wait the host clock subtracts). The hosts only enqueue, so the host clock cannot tell the ranks apart;
    the CUDA events of `StragglerDetector.for_device` must name the last rank."""
    from megaloom.parallel import comm
    from megaloom.parallel.comm import LastOpRecorder
    from megaloom.parallel.host_group import HostGroup
    from megaloom.resilience.straggler import StragglerDetector

    gpu = torch.device("cuda:0")
    torch.cuda.set_device(gpu)
    control = HostGroup(120)
    rec = LastOpRecorder()
    det = StragglerDetector.for_device(gpu, world, 1.5, rec, control)
    n = 8192 if rank == world - 1 else 2048
    a = torch.randn(n, n, device=gpu)
    out = torch.empty_like(a)
    flag = torch.ones(1)
    for step in range(6):
        control.barrier()
        t0 = time.perf_counter()
        det.start_step()
        for _ in range(4):
            torch.mm(a, a, out=out)
        comm.all_reduce(flag, control.group, recorder=rec)
        det.end_step(time.perf_counter() - t0)
        torch.cuda.synchronize(gpu)  # outside the step: the next one starts on an idle device
        if step == 1:  # warm-up (kernel selection) out of the window
            det.check()
    stragglers, times = det.check()
    return {"stragglers": stragglers, "times": times, "device_timing": det.spans is not None}


def nccl_hang(out: str, overrides: list[str]) -> None:
    """A one-GPU NCCL world (world 1, as `init_runtime` starts one for world > 1: flight recorder configured
    first, the run's collective timeout) where an all-reduce is made to hang on the device: a spinning kernel
    ahead of it on the stream keeps it from starting, and the host then waits for the device. With the watchdog on,
    it fires and its report names the collective the flight recorder saw unfinished (exit code 3); with it off,
    NCCL's own timeout fires and dumps the flight recorder into run.dir/watchdog (the process aborts)."""
    _set_torchrun_env(0, 1, 0)
    for key in ("TORCH_FR_BUFFER_SIZE", "TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_TRACE_BUFFER_SIZE",
                "TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_NCCL_ASYNC_ERROR_HANDLING"):
        os.environ.pop(key, None)
    from megaloom.config import load_config
    from megaloom.parallel.comm import _recording
    from megaloom.parallel.host_group import HostGroup
    from megaloom.parallel.mesh import Mesh
    from megaloom.resilience import flight_recorder
    from megaloom.resilience.guard import Resilience
    from megaloom.resilience.straggler import StragglerDetector
    from megaloom.runtime import collective_timeout

    cfg = load_config(None, overrides)
    device = torch.device("cuda:0")
    torch.cuda.set_device(device)
    flight_recorder.configure(cfg.run.dir)
    dist.init_process_group("nccl", init_method=f"file://{out}/init", rank=0, world_size=1, device_id=device,
                            timeout=collective_timeout(cfg))
    mesh = Mesh.single(device)
    guard = Resilience(cfg, Path(cfg.run.dir), 0, 1, mesh)
    # the side group next to an NCCL world bound to its device (device_id), as in `megaloom train` on GPUs
    det = StragglerDetector(1, 1.5, mesh.recorder, HostGroup(cfg.resilience.collective_timeout_s))
    det.start_step()
    det.end_step(0.25)
    torch.save({"straggler": det.check(), "control_backend": dist.get_backend(det.group.group),
                "world_cpu_error": _cpu_collective_on_world_fails()}, Path(out) / "side_group.pt")
    x = torch.ones(1 << 20, device=device)
    model = torch.nn.Linear(2, 2)
    for step in (1, 2):
        guard.before_step(step, model)
        if step == 2:
            torch.cuda._sleep(200 * 10**9)  # ~100 s of spinning ahead of the collective on this stream
        with _recording(mesh.recorder, "all_reduce_sum", dist.group.WORLD, x.numel() * 4):
            dist.all_reduce(x)  # returns once enqueued: the host thinks it "returned"
        torch.cuda.synchronize(device)  # step 2: the host waits for the device, which never gets there
        guard.after_step(step, False, 0.0)
    time.sleep(300)  # not reached
