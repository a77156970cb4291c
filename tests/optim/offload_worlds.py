"""What the ranks of a dp2 world (gloo) run for train.optimizer_offload (test_offload_world2.py): the offloaded AdamW
against the on-device one of the same layout, in the same rank, on tests/parallel/dp's tiny model and batches."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import torch
import torch.distributed as dist

from megaloom.checkpoint.store import load_checkpoint, save_checkpoint
from megaloom.config import load_config
from megaloom.optim.offload import build_offloaded
from megaloom.optim.zero import ShardedOptimizer, build_data_parallel
from megaloom.parallel.mesh import Mesh
from megaloom.parallel.tensor import parallelize_tensor
from tests.parallel.dp.dp_worlds import (
    BETAS,
    BUCKET_MB,
    EPS,
    GLOBAL_BATCH,
    LR,
    WD,
    base_model,
    full_params_after,
    global_batches,
    plain_optimizer,
    run_steps,
)
from tests.parallel.worlds import tiny_config

TRAIN = load_config(None, ["train.optimizer_offload=true", f"train.lr={LR}", f"train.beta1={BETAS[0]}",
                           f"train.beta2={BETAS[1]}", f"train.weight_decay={WD}"]).train


def _build(base, mesh: Mesh, zero: int, offload: bool, fused: bool = False):
    model = parallelize_tensor(copy.deepcopy(base), mesh, False)
    grads = build_data_parallel(model, mesh, zero, BUCKET_MB)
    if offload:  # fused=False: the on-device step's kernel on CPU (foreach)
        opt = build_offloaded(model, grads, TRAIN, mesh.device, zero, fused=fused)
    elif zero:
        opt = ShardedOptimizer(grads, "adamw", lr=LR, betas=BETAS, eps=EPS["adamw"], weight_decay=WD)
    else:
        opt = plain_optimizer(model, "adamw", mesh)
    return model, grads, opt


def _train(base, mesh: Mesh, zero: int, offload: bool, clip: float, fused: bool = False) -> dict:
    model, grads, opt = _build(base, mesh, zero, offload, fused)
    micro = GLOBAL_BATCH // mesh.dp // 2
    loss, norm = run_steps(model, grads, opt, mesh, global_batches(), micro, clip, None)
    device_state = opt.state_bytes() if hasattr(opt, "state_bytes") else sum(
        v.numel() * v.element_size() for st in opt.state.values() for v in st.values() if v.ndim > 0)
    return dict(loss=loss, norm=norm, params=full_params_after(model, mesh), device_state=device_state,
                host=opt.host_bytes() if offload else 0,
                shard=sum(s.data.numel() for s in grads.shard_segments()) if zero else
                sum(p.numel() for p in model.parameters()))


def parity_case(mesh: Mesh, zero: int, clip: float, fused: bool = False) -> dict:
    """10 steps of two micro-batches: the on-device AdamW and the offloaded one from the same weights."""
    base = base_model("llama", mesh)
    ref = _train(base, mesh, zero, False, clip)
    got = _train(base, mesh, zero, True, clip, fused)
    err = max((got["params"][n] - p).abs().max().item() for n, p in ref["params"].items())
    scale = max(p.abs().max().item() for p in ref["params"].values())
    return dict(loss=got["loss"], ref_loss=ref["loss"], norm=got["norm"], ref_norm=ref["norm"], param_err=err,
                scale=scale, device_state=got["device_state"], ref_device_state=ref["device_state"],
                host=got["host"], shard=got["shard"])


def resume_case(mesh: Mesh, zero: int, root: str) -> dict:
    """5 steps offloaded, save_checkpoint, 5 more; against a fresh model and offloaded optimizer loaded from the
    checkpoint, 5 steps; and an on-device ZeRO optimizer loaded from it (the same keys), 5 steps."""
    base = base_model("llama", mesh)
    batches, micro = global_batches(), GLOBAL_BATCH // mesh.dp // 2
    model, grads, opt = _build(base, mesh, zero, True)
    run_steps(model, grads, opt, mesh, batches[:5], micro, math.inf, None)
    path = save_checkpoint(Path(root) / f"z{zero}", 5, model, opt, {}, keep=1, rank=mesh.rank,
                           barrier=dist.barrier, mesh=mesh)
    straight, _ = run_steps(model, grads, opt, mesh, batches[5:], micro, math.inf, None)
    out = dict(straight=straight)
    for name, offload in (("resumed", True), ("on_device", False)):
        scrambled = copy.deepcopy(base)
        with torch.no_grad():
            for p in scrambled.parameters():
                p.mul_(0.5)  # other weights: the load must overwrite them
        model, grads, opt = _build(scrambled, mesh, zero, offload)
        load_checkpoint(path, model, opt, rank=mesh.rank, mesh=mesh)
        out[name], _ = run_steps(model, grads, opt, mesh, batches[5:], micro, math.inf, None)
    return out


def order_case(mesh: Mesh, zero: int) -> dict:
    """One offloaded ZeRO step, its host steps and parameter all-gathers logged in the order they happen."""
    base = base_model("llama", mesh)
    model, grads, opt = _build(base, mesh, zero, True)
    log: list[tuple[str, int]] = []
    step_chunk, gather = opt._step_chunk, grads.gather_bucket

    def logged_step(i, hyper):
        log.append(("host step", i))
        step_chunk(i, hyper)

    def logged_gather(b):
        log.append(("gather", grads.buckets.index(b)))
        gather(b)

    opt._step_chunk, grads.gather_bucket = logged_step, logged_gather
    run_steps(model, grads, opt, mesh, global_batches()[:1], GLOBAL_BATCH // mesh.dp // 2, math.inf, None)
    grads.wait_params()
    return dict(log=log, buckets=len(grads.buckets))


def suite_offload_dp2(rank: int, world: int, device: torch.device, root: str) -> dict:
    mesh = Mesh.build(tiny_config(world=world), world, rank, device)
    res = {}
    for zero in (0, 1, 2):
        res[f"z{zero}"] = parity_case(mesh, zero, math.inf)
    res["z1-clip"] = parity_case(mesh, 1, 0.05)
    res["z1-fused"] = parity_case(mesh, 1, 0.05, fused=True)
    res["z1-resume"] = resume_case(mesh, 1, root)
    for zero in (1, 2):
        res[f"z{zero}-order"] = order_case(mesh, zero)
    return res
