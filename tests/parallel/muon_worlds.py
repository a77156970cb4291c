"""What the spawned ranks run for the Muon tests (megaloom/optim/muon.py): each case trains the tiny model a few
steps at one layout and reports the largest difference of every parameter, after every step, from the single
process running the same global batches (computed in each rank, cached). Newton-Schulz runs in fp32 here, so the
layouts must agree to fp32 rounding; production runs it in bf16.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from megaloom.checkpoint.store import load_checkpoint, save_checkpoint
from megaloom.data.objective import inputs_and_labels
from megaloom.models.registry import get_family
from megaloom.optim.muon import ShardedMuon, build_muon
from megaloom.optim.qk_clip import install_qk_clip
from megaloom.optim.zero import build_data_parallel
from megaloom.parallel import comm
from megaloom.parallel.mesh import Mesh
from megaloom.parallel.pipeline.stage import build_embedding_groups
from megaloom.parallel.tensor import parallelize_tensor

from .dp.dp_worlds import BUCKET_MB, GLOBAL_BATCH, full_params_after, global_batches, run_steps
from .pipeline import zero_pp_worlds as zpp
from .worlds import tiny_config

STEPS, LR, WD, BETAS, MOMENTUM = 5, 2e-2, 0.1, (0.9, 0.95), 0.95
NS = torch.float32  # parity in fp32 (production: bf16)
TAU = 0.1  # QK-clip cases: the tiny model's logits are 0.07-0.18 over the 5 steps, so some heads clip, some not
MOE = ("model.moe_every=1", "model.n_experts=4", "model.top_k=2", "model.capacity_factor=0", "model.aux_loss_weight=0")


def base_model(mesh: Mesh, moe: bool) -> nn.Module:
    cfg = tiny_config(tp=mesh.tp, ep=mesh.ep, world=mesh.world_size, extra=MOE if moe else ())
    torch.manual_seed(1234)
    return get_family(cfg.model.arch).build(cfg.model).to(mesh.device)


def reference(mesh: Mesh, moe: bool, cache: dict, tau: float = 0.0) -> list[dict[str, torch.Tensor]]:
    """The single process on each whole global batch: its parameters after every step (``tau``: QK-clip)."""
    if (moe, tau) not in cache:
        single = Mesh.single(mesh.device)
        model = base_model(single, moe)
        opt = build_muon(model, single, LR, WD, BETAS, MOMENTUM, ns_dtype=NS)
        clip = install_qk_clip(model, opt, tau, single) if tau else None
        after = []
        for batch in global_batches(STEPS):
            model(*inputs_and_labels(batch.to(mesh.device))).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            after.append({n: p.detach().clone() for n, p in model.named_parameters()})
        cache[(moe, tau)] = after
        cache[("clipped", tau)] = clip.clipped if clip is not None else 0
    return cache[(moe, tau)]


def build(base: nn.Module, mesh: Mesh, zero: int, tau: float = 0.0):
    model = parallelize_tensor(copy.deepcopy(base), mesh, False)
    grads = build_data_parallel(model, mesh, zero, BUCKET_MB)
    if zero:
        opt = ShardedMuon(grads, lr=LR, betas=BETAS, weight_decay=WD, momentum=MOMENTUM, ns_dtype=NS)
    else:
        opt = build_muon(model, mesh, LR, WD, BETAS, MOMENTUM, ns_dtype=NS)
    if tau:
        opt.qk_clip = install_qk_clip(model, opt, tau, mesh)
    return model, grads, opt


def _error(model: nn.Module, mesh: Mesh, ref: dict[str, torch.Tensor]) -> float:
    full = full_params_after(model, mesh)
    return max((full[n] - p).abs().max().item() for n, p in ref.items())


def train(model, grads, opt, mesh: Mesh, batches: list[torch.Tensor], ref: list[dict], first: int) -> list[float]:
    """One step per batch (two micro-batches each); the error after each against the reference's step."""
    micro = GLOBAL_BATCH // mesh.dp // 2
    errors = []
    for i, batch in enumerate(batches):
        run_steps(model, grads, opt, mesh, [batch], micro, math.inf, None)
        errors.append(_error(model, mesh, ref[first + i]))
    return errors


def parity_case(mesh: Mesh, zero: int, cache: dict, moe: bool = False, tau: float = 0.0) -> dict:
    """``tau`` > 0: with QK-clip (the single process clipped too); ``clipped``: (layer, head) pairs this rank
    scaled, ``ref_clipped``: the single process's."""
    ref = reference(mesh, moe, cache, tau)
    model, grads, opt = build(base_model(mesh, moe), mesh, zero, tau)
    errors = train(model, grads, opt, mesh, global_batches(STEPS), ref, 0)
    moved = max((ref[-1][n] - ref[0][n]).abs().max().item() for n in ref[0])
    state = {k for st in opt_state(opt).values() for k in st}
    clip = getattr(opt, "qk_clip", None)
    return dict(errors=errors, moved=moved, state_keys=sorted(state), gather=opt_inner(opt).gather_elements(),
                clipped=clip.clipped if clip is not None else 0, ref_clipped=cache.get(("clipped", tau), 0))


def opt_inner(opt):
    return getattr(opt, "inner", opt)


def opt_state(opt) -> dict:
    return opt_inner(opt).state


def resume_case(mesh: Mesh, zero: int, other: Mesh, other_zero: int, root: str, cache: dict) -> dict:
    """3 steps at (mesh, zero), a checkpoint, a fresh model and optimizer at (other, other_zero) loaded from it,
    2 more steps: against the single process's 5; and the same resume with the momentum zeroed, which must
    differ (the momentum is what makes the resume exact)."""
    ref = reference(mesh, False, cache)
    batches = global_batches(STEPS)
    model, grads, opt = build(base_model(mesh, False), mesh, zero)
    first = train(model, grads, opt, mesh, batches[:3], ref, 0)
    path = save_checkpoint(Path(root) / f"muon-z{zero}-{mesh.tp}", 3, model, opt, {}, keep=1, rank=mesh.rank,
                           barrier=dist.barrier, mesh=mesh)
    out: dict = dict(first=first)
    for name, zeroed in (("resumed", False), ("zeroed", True)):
        model, grads, opt = build(base_model(other, False), other, other_zero)
        load_checkpoint(path, model, opt, rank=other.rank, mesh=other)
        steps = {float(st["step"]) for st in opt_state(opt).values()}
        if zeroed:
            for st in opt_state(opt).values():
                if "momentum_buffer" in st:
                    st["momentum_buffer"].zero_()
        out[name] = train(model, grads, opt, other, batches[3:], ref, 3)
        out[f"{name}_steps"] = sorted(steps)
    return out


def pipeline_cases(world: int, rank: int, device: torch.device, zeros: tuple[int, ...]) -> dict:
    """Muon through the pipeline executor and TrainStep (tests/parallel/pipeline/zero_pp_worlds.py's cases: 1F1B,
    4 micro-batches, gradients clipped, 4 steps): pp2 x dp (world / 2) at each ZeRO stage of ``zeros``."""
    mesh = Mesh.build(zpp.config(pp=2, world=world), world, rank, device)
    emb, cache = build_embedding_groups(mesh), {}
    tag = "pp2" if mesh.dp == 1 else f"pp2dp{mesh.dp}"
    return {f"{tag}-z{z}": zpp.zero_pp_case(mesh, emb, cache, "1f1b", zero=z, kind="muon") for z in zeros}


MUON_OPS = ("reduce", "broadcast", "gather", "scatter")  # Muon's exchange (ZeRO's own are reduce_scatter, all_gather)


def tally_case(mesh: Mesh, zero: int, moe: bool = False) -> dict[str, int]:
    """One step with a `comm.CommTally` on the mesh's recorder: the bytes of Muon's exchange ops this rank
    recorded, "group op" -> bytes (the planner's count is checked against their sum over the ranks)."""
    model, grads, opt = build(base_model(mesh, moe), mesh, zero)
    names = {g: "dp" for g in (mesh.dp_group, mesh.dp_cp_group, mesh.edp_group) if g is not None}
    if mesh.tp_group is not None:
        names[mesh.tp_group] = "tp"
    tally = comm.CommTally(names)
    mesh.recorder = tally
    try:
        train(model, grads, opt, mesh, global_batches(1), reference(mesh, moe, {}), 0)
    finally:
        mesh.recorder = comm.NullRecorder()
    return {f"{g} {op}": n for (g, op), n in tally.bytes.items() if op in MUON_OPS}


def suite_muon2(rank: int, world: int, device: torch.device, root: str) -> dict:
    cache: dict = {}
    dp = Mesh.build(tiny_config(world=world), world, rank, device)
    tp = Mesh.build(tiny_config(tp=2, world=world), world, rank, device)
    ep = Mesh.build(tiny_config(ep=2, world=world, extra=MOE), world, rank, device)
    res = {"tp2-z0": parity_case(tp, 0, cache), "dp2-z0": parity_case(dp, 0, cache),
           "dp2-z1": parity_case(dp, 1, cache), "dp2-z2": parity_case(dp, 2, cache),
           "ep2-z0": parity_case(ep, 0, cache, moe=True), "ep2-z1": parity_case(ep, 1, cache, moe=True),
           "tp2-z0-clip": parity_case(tp, 0, cache, tau=TAU), "dp2-z1-clip": parity_case(dp, 1, cache, tau=TAU)}
    res["dp2-z1-to-tp2-z0"] = resume_case(dp, 1, tp, 0, root, cache)
    res.update(pipeline_cases(world, rank, device, (0,)))
    res["tally-tp2-z0"], res["tally-ep2-z1"] = tally_case(tp, 0), tally_case(ep, 1, moe=True)
    return res


def suite_muon4(rank: int, world: int, device: torch.device, root: str) -> dict:
    cache: dict = {}
    tp2 = Mesh.build(tiny_config(tp=2, world=world), world, rank, device)
    tp4 = Mesh.build(tiny_config(tp=4, world=world), world, rank, device)  # 2 KV heads: replicated on 2 ranks each
    res = {"tp2dp2-z0": parity_case(tp2, 0, cache), "tp2dp2-z1": parity_case(tp2, 1, cache),
           "tp2dp2-z2": parity_case(tp2, 2, cache), "tp4-z0": parity_case(tp4, 0, cache),
           "tp2dp2-z1-clip": parity_case(tp2, 1, cache, tau=TAU), "tp4-z0-clip": parity_case(tp4, 0, cache, tau=TAU)}
    dp4 = Mesh.build(tiny_config(world=world), world, rank, device)
    res["tp2dp2-z2-to-dp4-z1"] = resume_case(tp2, 2, dp4, 1, root, cache)
    res.update(pipeline_cases(world, rank, device, (0, 1)))
    res["tally-tp2dp2-z1"] = tally_case(tp2, 1)
    return res
