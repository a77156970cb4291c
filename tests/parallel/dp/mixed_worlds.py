"""Rank functions for the parameter-gather dtype tests (test_gather_dtype_world2.py): numbers, not assertions."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from megaloom.optim.zero import ShardedOptimizer, build_data_parallel
from megaloom.parallel import comm
from megaloom.parallel.mesh import Mesh
from megaloom.parallel.tensor import parallelize_tensor
from megaloom.step import TrainStep

from ..worlds import tiny_config
from .dp_worlds import BETAS, EPS, LR, WD, base_model, global_batches


class DistBytes:
    """FSDP2 calls torch.distributed itself (not megaloom.parallel.comm): count the bytes of its all-gathers and
    reduce-scatters on ``group`` by wrapping both names of each (2.13's and 2.11's). Test instrumentation only."""

    NAMES = {"all_gather": ("all_gather_single", "all_gather_into_tensor"),
             "reduce_scatter": ("reduce_scatter_single", "reduce_scatter_tensor")}

    def __init__(self, group) -> None:
        self.group, self.bytes, self.saved = group, {"all_gather": 0, "reduce_scatter": 0}, {}

    def __enter__(self) -> DistBytes:
        for op, names in self.NAMES.items():
            for name in names:
                fn = getattr(dist, name, None)
                if fn is None or name in self.saved:
                    continue
                self.saved[name] = fn

                def counted(*args, _fn=fn, _op=op, **kw):
                    if kw.get("group") is self.group:  # the op's buffer: the gathered output, the scattered input
                        tensors = [t for t in (*args, *kw.values()) if torch.is_tensor(t)]
                        self.bytes[_op] += max(t.numel() * t.element_size() for t in tensors)
                    return _fn(*args, **kw)

                setattr(dist, name, counted)
        return self

    def __exit__(self, *exc) -> None:
        for name, fn in self.saved.items():
            setattr(dist, name, fn)


def gather_dtype_case(mesh: Mesh, zero: int, dtype: torch.dtype, low: bool = False, fused: bool = False,
                      clip: float = 1.0, untied: bool = False, sp: bool = False) -> dict:
    """Three bf16 steps (autocast) at dp=2 with the parameter gathers in ``dtype``: bytes per step on the
    data-parallel group (the recorder for ZeRO-1/2, the wrapped collectives for FSDP2), the dtypes held.
    ``low``: train.bf16_params (the parameters themselves in ``dtype``, fp32 only in the master shards).
    ``fused``: train.grad_accum_fusion (the blocks' weight gradients added into the buckets by their GEMMs).
    ``untied``: the head gets its own copy of the embedding's values (then the token embedding fuses too)."""
    model = copy.deepcopy(base_model("llama", mesh))
    if untied:
        model.head.weight = torch.nn.Parameter(model.tok_emb.weight.detach().clone())
    model = parallelize_tensor(model, mesh, sp)
    tally = comm.CommTally({mesh.dp_cp_group: "dp"})
    with DistBytes(mesh.dp_cp_group) as fsdp:
        grads = build_data_parallel(model, mesh, zero, 0.05, dtype, low_precision_params=low)
        n_fused = grads.enable_fusion(model) if fused else 0
        opt = ShardedOptimizer(grads, "adamw", lr=LR, betas=BETAS, eps=EPS["adamw"], weight_decay=WD)
        masters0 = [t.detach().clone() for t in opt.tensors]  # the build's values (before any step)
        step = TrainStep(model, opt, "bf16", mesh.device, 2, clip, grads)
        rows = 8 // mesh.dp
        losses = []
        seen: list[torch.dtype] = []
        hook = model.layers["0"].attn.register_forward_pre_hook(
            lambda m, a: seen.append(next(m.parameters()).dtype))
        for i, batch in enumerate(global_batches(3)):
            if i == 1:  # count steps 2 and 3 (step 1's gathers were issued in step 0's set-up for FSDP2)
                mesh.recorder = tally
                fsdp.bytes = {k: 0 for k in fsdp.bytes}
            losses.append(step(batch[mesh.dp_rank * rows:(mesh.dp_rank + 1) * rows].to(mesh.device)).loss.item())
        mesh.recorder = comm.NullRecorder()
        hook.remove()
        if zero < 3:
            grads.wait_params()
    rows_ = tally.rows()
    by = {r["op"]: r["bytes"] for r in rows_ if r["group"] == "dp"}
    out = dict(loss=losses, compute_dtype=str(seen[-1]),
               master=str(opt.tensors[0].dtype), shard_numel=sum(t.numel() for t in opt.tensors),
               masters0=masters0, fused=n_fused, masters=[t.detach().clone() for t in opt.tensors],
               param_bytes=sum(p.numel() * p.element_size() for p in model.parameters()))
    out["weights"] = [p.detach().clone() for p in model.parameters()]
    if zero < 3:  # the replicas hold the masters rounded (this rank's segments of the gathered weights)
        out["rounded"] = all(torch.equal(s.data, t.detach().to(dtype).to(s.data.dtype)) for s, t in
                             zip(opt.segments, opt.tensors, strict=True))
        out["master_init_left"] = any(b.master_init is not None for b in grads.buckets)
    if zero == 3:
        out.update(gather=fsdp.bytes["all_gather"], reduce=fsdp.bytes["reduce_scatter"])
    else:
        out.update(gather=by.get("all_gather", 0), reduce=by.get("reduce_scatter", 0))
    return out


def suite_gather_dtype_world2(rank: int, world: int, device: torch.device) -> dict:
    mesh = Mesh.build(tiny_config(world=world), world, rank, device)
    res = {}
    for zero in (1, 2, 3):
        for dtype in (torch.float32, torch.bfloat16):
            res[f"z{zero}-{str(dtype).removeprefix('torch.')}"] = gather_dtype_case(mesh, zero, dtype)
        if zero < 3:
            res[f"z{zero}-bf16-params"] = gather_dtype_case(mesh, zero, torch.bfloat16, low=True)
    res["z1-bf16-params-fused"] = gather_dtype_case(mesh, 1, torch.bfloat16, low=True, fused=True)
    for fused in (False, True):  # an untied token embedding: its weight gradient fused too
        res[f"z1-bf16-params-untied-{fused}"] = gather_dtype_case(mesh, 1, torch.bfloat16, low=True, fused=fused,
                                                                  untied=True)
    for zero in (0, 1):  # without clipping (the norm's summation order differs between the layouts): bit for bit
        res[f"z{zero}-bf16-params-noclip"] = gather_dtype_case(mesh, zero, torch.bfloat16, low=True,
                                                               fused=not zero, clip=float("inf"))
    return res
