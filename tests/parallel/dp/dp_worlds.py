"""What the spawned ranks run for the data-parallel / ZeRO tests: one suite per world, each returning a dict
of measurements per rank (assertions happen in the test process, which sees every rank).

Every case trains the tiny model for 10 steps on the same global batches as a single-process reference
(computed in the same rank, cached per optimizer/clip setting) and reports both loss curves, the bucket
counters, a log of the collectives issued on the data-parallel group per phase, and memory.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from megaloom.checkpoint.store import CheckpointError, load_checkpoint, save_checkpoint
from megaloom.data.objective import inputs_and_labels, objective_kwargs
from megaloom.models import Transformer
from megaloom.models.registry import get_family
from megaloom.optim.lamb import build_lamb
from megaloom.optim.param_groups import param_groups
from megaloom.optim.zero import ShardedOptimizer, build_data_parallel
from megaloom.parallel import comm
from megaloom.parallel.mesh import Mesh
from megaloom.parallel.state import ensure_optimizer_state
from megaloom.parallel.tensor import gather_full_params, parallelize_tensor

from ..full_state import (
    fsdp_model_state,
    full_optim_state,
    full_optimizer_state,
    load_full_model_state,
    load_full_optimizer_state,
    sharded_model_state,
)
from ..llava_worlds import llava_dp_case
from ..worlds import BERT_SOP, UNTIED, tiny_config, token_rows

GLOBAL_BATCH, STEPS, LR, WD, BETAS = 8, 10, 3e-3, 0.1, (0.9, 0.95)
BUCKET_MB = 0.05  # ~13k fp32 elements: the tiny model (~80k parameters) spreads over several buckets
EPS = {"adamw": 1e-8, "lamb": 1e-6}


class PhaseRecorder(comm.OpRecorder):
    """Logs every collective issued on one group, tagged with the phase the training loop says it is in."""

    def __init__(self, group: comm.Group) -> None:
        self.group, self.phase, self.log = group, "setup", []

    def enter(self, name: str, group: comm.Group, nbytes: int = 0) -> None:
        # A "wait ..." entry is the completion of a collective issued earlier (recorded for the watchdog),
        # not a new one: only issued collectives count here.
        if group is self.group and not name.startswith("wait "):
            self.log.append((self.phase, name))


@contextlib.contextmanager
def fsdp_reductions_logged(rec: PhaseRecorder) -> Iterator[None]:
    """FSDP2 (zero=3) calls torch.distributed itself: wrap its reduce-scatter (2.13 name and 2.11 name) so the
    recorder sees it too. Test instrumentation only."""
    saved = {}
    for name in ("reduce_scatter_single", "reduce_scatter_tensor"):
        fn = getattr(dist, name, None)
        if fn is None:
            continue
        saved[name] = fn

        def logged(*args, _fn=fn, _name=name, **kwargs):
            if kwargs.get("group") is rec.group:
                rec.log.append((rec.phase, "fsdp_" + _name))
            return _fn(*args, **kwargs)

        setattr(dist, name, logged)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def global_batches(steps: int = STEPS, arch: str = "llama") -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(99)
    return [token_rows(gen, GLOBAL_BATCH, arch) for _ in range(steps)]


def base_model(arch: str, mesh: Mesh) -> Transformer:
    cfg = tiny_config(arch, tp=mesh.tp, world=mesh.world_size)
    torch.manual_seed(1234)
    return get_family(cfg.model.arch).build(cfg.model).to(mesh.device)  # t5: its encoder-decoder module


def plain_optimizer(model: nn.Module, kind: str, mesh: Mesh | None) -> torch.optim.Optimizer:
    if kind == "lamb":
        return build_lamb(model, WD, LR, BETAS, EPS["lamb"], mesh=mesh)
    return torch.optim.AdamW(param_groups(model, WD), lr=LR, betas=BETAS, eps=EPS["adamw"], foreach=True)


def reference(arch: str, kind: str, clip: float, cache: dict, device: torch.device) -> dict:
    """The single-process run on the full global batch (each rank computes it; cached per setting)."""
    key = (arch, kind, clip)
    if key not in cache:
        model = base_model(arch, Mesh.single(device))
        opt = plain_optimizer(model, kind, None)
        losses, norms, states = [], [], {}
        for step, batch in enumerate(global_batches(arch=arch)):
            batch = batch.to(device)
            loss = model(*inputs_and_labels(batch), **objective_kwargs(batch))
            loss.backward()
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip, foreach=True).item())
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
            if step == 4:
                # A copy: AdamW keeps incrementing its step tensors in place.
                states["mid"] = copy.deepcopy(full_optim_state(model, opt, Mesh.single())["state"])
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
        cache[key] = dict(loss=losses, norm=norms, state=states["mid"], params=params)
    return cache[key]


def make_parallel(base: nn.Module, mesh: Mesh, zero: int, kind: str, sp: bool = False,
                  full_params: dict | None = None, fused: bool = False):
    model = copy.deepcopy(base)
    if full_params is not None:
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(full_params[n])
    model = parallelize_tensor(model, mesh, sp)
    grads = build_data_parallel(model, mesh, zero, BUCKET_MB)
    if fused:  # train.grad_accum_fusion: the blocks' weight gradients go into the buckets in their GEMMs
        grads.n_fused = grads.enable_fusion(model)
    if zero == 0:
        opt = plain_optimizer(model, kind, mesh)
    else:
        opt = ShardedOptimizer(grads, kind, lr=LR, betas=BETAS, eps=EPS[kind], weight_decay=WD)
    return model, grads, opt


def run_steps(model, grads, opt, mesh: Mesh, batches: list[torch.Tensor], micro: int, clip: float,
              rec: PhaseRecorder | None) -> tuple[list[float], list[float]]:
    """TrainStep's loop with the data-parallel calls: this rank's slice, micro-batches, the last one armed."""
    local = GLOBAL_BATCH // mesh.dp
    losses, norms = [], []
    for batch in batches:
        if hasattr(grads, "prepare_step"):
            grads.prepare_step()  # as TrainStep: the buckets cleared before the first backward
        rows = batch[mesh.dp_rank * local:(mesh.dp_rank + 1) * local].to(mesh.device)
        n_micro = local // micro
        total = torch.zeros((), device=mesh.device)
        for i in range(n_micro):
            last = i == n_micro - 1
            if rec is not None:
                rec.phase = "last_micro" if last else "early_micro"
            if last:
                grads.start_last_microbatch()
            chunk = rows[i * micro:(i + 1) * micro]
            loss = model(*inputs_and_labels(chunk), **objective_kwargs(chunk)) / n_micro
            loss.backward()
            total += loss.detach()
        if rec is not None:
            rec.phase = "finish"
        grads.finish()
        if rec is not None:
            rec.phase = "after"
        norms.append(grads.clip(clip).item())
        opt.step()
        opt.zero_grad(set_to_none=True)
        comm.all_reduce(total, mesh.dp_cp_group)
        losses.append(total.item() / mesh.dp)
    return losses, norms


def total_numel(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def write_imported(root: str, rank: int, device: torch.device) -> Path:
    """A model-only checkpoint of the reference's initial weights, as `megaloom convert --from-hf` writes one
    (`save_checkpoint` without an optimizer, full tensors of the single model; every rank calls this)."""
    base = base_model("llama", Mesh.single(device))
    return save_checkpoint(Path(root) / "imported" / "checkpoints", 0, base, None, {}, keep=1, rank=rank,
                           barrier=dist.barrier)


def scrambled(base: nn.Module) -> nn.Module:
    """``base`` with other weights: what loading a checkpoint into it must overwrite."""
    model = copy.deepcopy(base)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen).to(p.device))
    return model


def imported_check(path: Path, model: nn.Module, grads, opt, mesh: Mesh, zero: int) -> dict:
    """Load the model-only checkpoint ``path`` into the parallel model as the trainer does (optimizer given):
    every weight must equal the single-process load of it exactly, and the optimizer state stay fresh."""
    try:
        load_checkpoint(path, model, opt, rank=mesh.rank, mesh=mesh)
    except CheckpointError as e:  # every rank gets DCP's verdict: this case fails, the world goes on
        return {"imported_equal": False, "fresh_optimizer": False, "error": str(e)}
    single = scrambled(base_model("llama", Mesh.single(mesh.device)))
    load_checkpoint(path, single, None)
    loaded = fsdp_model_state(grads) if zero == 3 else full_params_after(model, mesh)
    want = dict(single.named_parameters())
    written = dict(base_model("llama", Mesh.single(mesh.device)).named_parameters())
    equal = all(torch.equal(loaded[n], p.detach()) and torch.equal(p, written[n]) for n, p in want.items())
    if zero:
        fresh = all(float(st["step"]) == 0 and not st["exp_avg"].any() and not st["exp_avg_sq"].any()
                    for st in opt.inner.state.values())
    else:
        fresh = not opt.state
    return {"imported_equal": equal, "fresh_optimizer": fresh}


def stage_case(mesh: Mesh, root: str) -> dict:
    """checkpoint.resume of a checkpoint saved with another model.freeze (a new training stage: its weights only,
    step 0) into ZeRO-1 with bf16 parameter gathers, through the trainer's RunCheckpoints: the optimizer's fp32
    master shards must take the loaded weights (else its first step publishes the masters it was built with over
    them), the replicas their bf16 rounding, and the optimizer state stays fresh."""
    from megaloom.runtime import Runtime
    from megaloom.training.checkpoints import RunCheckpoints

    written = base_model("llama", Mesh.single(mesh.device))
    stage1 = torch.optim.AdamW(written.parameters(), lr=LR)
    ensure_optimizer_state(written, stage1)
    path = save_checkpoint(Path(root) / "stage1" / "checkpoints", 2, written, stage1,
                           {"model": {**tiny_config().model.__dict__, "freeze": ["language"]}}, keep=1,
                           rank=mesh.rank, barrier=dist.barrier)
    cfg = tiny_config(world=mesh.world_size)
    cfg.checkpoint.resume = str(path)
    model = parallelize_tensor(scrambled(written), mesh, False)
    grads = build_data_parallel(model, mesh, 1, BUCKET_MB, torch.bfloat16)
    opt = ShardedOptimizer(grads, "adamw", lr=LR, betas=BETAS, eps=EPS["adamw"], weight_decay=WD)
    rt = Runtime(mesh.device, mesh.rank, mesh.world_size, mesh.rank)
    step, _ = RunCheckpoints(cfg, Path(root) / "stage2", rt, mesh).resume(model, opt)
    want = {n: p.detach() for n, p in written.named_parameters()}
    masters = all(torch.equal(t.detach().reshape(-1), want[opt.named_params[s.owner][0]].reshape(-1)[
        s.start:s.start + t.numel()]) for t, s in zip(opt.tensors, opt.segments, strict=True))
    grads.wait_params()
    replicas = all(torch.equal(p.detach(), want[n].bfloat16().float()) for n, p in model.named_parameters())
    fresh = all(float(st["step"]) == 0 and not st["exp_avg"].any() for st in opt.inner.state.values())
    return {"step": step, "masters": masters, "replicas": replicas, "fresh": fresh, "separate": opt.separate_masters}


def dp_case(mesh: Mesh, zero: int, kind: str = "adamw", clip: float = math.inf, arch: str = "llama",
            sp: bool = False, cache: dict | None = None, roundtrip: bool = False, fused: bool = False,
            imported: Path | None = None) -> dict:
    """Train 10 steps at this layout (two micro-batches per step) and report what the tests check.
    ``imported``: a model-only checkpoint of the reference's initial weights (`write_imported`), loaded into a
    model built with other weights before training."""
    ref = reference(arch, kind, clip, {} if cache is None else cache, mesh.device)
    base = base_model(arch, mesh)
    micro = GLOBAL_BATCH // mesh.dp // 2
    rec = PhaseRecorder(mesh.dp_cp_group)
    out: dict = dict(zero=zero, ref_loss=ref["loss"], ref_norm=ref["norm"], dp=mesh.dp, clip=clip, n_micro=2)
    mesh.recorder = rec
    with contextlib.ExitStack() as stack:
        if zero == 3:
            stack.enter_context(fsdp_reductions_logged(rec))
        stack.callback(setattr, mesh, "recorder", comm.NullRecorder())
        model, grads, opt = make_parallel(base if imported is None else scrambled(base), mesh, zero, kind, sp,
                                          fused=fused)
        if imported is not None:
            out.update(imported_check(imported, model, grads, opt, mesh, zero))
        out["numel"] = total_numel(model)
        out["fused"] = getattr(grads, "n_fused", 0)
        batches = global_batches(arch=arch)
        if roundtrip:  # 5 steps, a layout-free save, a fresh model + optimizer loaded from it, 5 more steps
            l1, n1 = run_steps(model, grads, opt, mesh, batches[:5], micro, clip, rec)
            state = full_optimizer_state(opt) if zero else full_optim_state(model, opt, mesh)
            out["state_err"] = state_error(state["state"], ref["state"])
            full_params = sharded_model_state(opt) if zero else full_params_after(model, mesh)
            model, grads, opt = make_parallel(base, mesh, zero, kind, sp, full_params=None if zero else full_params)
            if zero:  # the sharded optimizer's own loading path for the weights
                load_full_model_state(opt, full_params)
            load_full_optimizer_state(opt, state)
            l2, n2 = run_steps(model, grads, opt, mesh, batches[5:], micro, clip, rec)
            out["loss"], out["norm"] = l1 + l2, n1 + n2
            out["counted_steps"] = len(batches) - 5  # the counters below are the second objects'
        else:
            out["loss"], out["norm"] = run_steps(model, grads, opt, mesh, batches, micro, clip, rec)
        out["log"] = rec.log
    out["stats"] = grads.stats.as_dict()
    out["n_buckets"] = len(getattr(grads, "buckets", []))
    out["n_params"] = len(grads.params)
    out["memory"] = grads.memory()
    if zero in (1, 2):  # where the reduced gradient of each optimizer segment lives
        buckets = {b.data.untyped_storage().data_ptr() for b in grads.buckets if b.data is not None}
        out["grads_in_buckets"] = all(s.grad.untyped_storage().data_ptr() in buckets for s in grads.shard_segments())
    if zero:
        out["state_bytes"] = opt.state_bytes()
    else:
        out["state_bytes"] = sum(v.numel() * v.element_size() for st in opt.state.values()
                                 for v in st.values() if torch.is_tensor(v) and v.ndim > 0)
    final = fsdp_model_state(grads) if zero == 3 else full_params_after(model, mesh)
    out["param_err"] = max((final[n] - p).abs().max().item() for n, p in ref["params"].items())
    return out


def full_params_after(model: nn.Module, mesh: Mesh) -> dict[str, torch.Tensor]:
    model.state_dict()  # the state-dict pre-hook waits for the parameter all-gathers still in flight
    return gather_full_params(model, mesh)


def state_error(got: dict, ref: dict) -> float:
    """Largest error of the optimizer state against the reference's, relative to the largest reference value."""
    worst = 0.0
    for name, st in ref.items():
        for k in ("exp_avg", "exp_avg_sq"):
            scale = st[k].abs().max().item() + 1e-12
            worst = max(worst, (got[name][k] - st[k]).abs().max().item() / scale)
        worst = max(worst, abs(float(got[name]["step"]) - float(st["step"])))
    return worst


# ---------------------------------------------------------------------------------------------------- suites


def suite_dp2(rank: int, world: int, device: torch.device, root: str) -> dict:
    from . import onebit_worlds  # it builds on this module

    mesh = Mesh.build(tiny_config(world=world), world, rank, device)
    cache: dict = {}
    res: dict = {}
    for zero in (0, 1, 2, 3):
        res[f"z{zero}-adamw"] = dp_case(mesh, zero, cache=cache)
    res["z1-adamw-clip"] = dp_case(mesh, 1, clip=0.05, cache=cache)
    res["z0-fused"] = dp_case(mesh, 0, cache=cache, fused=True)  # train.grad_accum_fusion
    res["z1-fused-clip"] = dp_case(mesh, 1, clip=0.05, cache=cache, fused=True)
    res["z2-adamw-clip"] = dp_case(mesh, 2, clip=0.05, cache=cache)
    res["z3-adamw-clip"] = dp_case(mesh, 3, clip=0.05, cache=cache)
    for zero in (0, 1, 2, 3):
        res[f"z{zero}-lamb"] = dp_case(mesh, zero, "lamb", cache=cache)
    res["z1-gpt2"] = dp_case(mesh, 1, arch="gpt2", cache=cache)
    res["z1-qwen3"] = dp_case(mesh, 1, arch="qwen3", cache=cache)
    res["z1-bert"] = dp_case(mesh, 1, arch="bert", cache=cache)
    res["z1-bert-sop"] = dp_case(mesh, 1, arch=BERT_SOP, cache=cache)  # sentence order: segments, pooled [CLS]
    res["z1-t5"] = dp_case(mesh, 1, arch="t5", cache=cache)
    res["z1-roundtrip"] = dp_case(mesh, 1, roundtrip=True, cache=cache)
    res["z3-roundtrip"] = dp_case(mesh, 3, roundtrip=True, cache=cache)
    res["z2-lamb-roundtrip"] = dp_case(mesh, 2, "lamb", roundtrip=True, cache=cache)
    imported = write_imported(root, rank, device)  # a model-only checkpoint (convert --from-hf) at ZeRO-1 and 3
    res["z1-model-only"] = dp_case(mesh, 1, cache=cache, imported=imported)
    res["z3-model-only"] = dp_case(mesh, 3, cache=cache, imported=imported)
    res["z1-bf16-new-stage"] = stage_case(mesh, root)  # the weights of another model.freeze stage's checkpoint
    res["z1-llava"] = llava_dp_case(mesh, 1)  # images through a ViT and projector, ZeRO-1
    res["z1-llava-frozen"] = llava_dp_case(mesh, 1, freeze="vision,language")  # projector-only pretraining
    res["onebit-collective"] = onebit_worlds.collective_case(mesh)  # 1-bit exchange, 1,000 steps vs float64
    res["rs-copy"] = reduce_scatter_copy(mesh)  # last: it tells malloc to return freed blocks from then on
    return res


def reduce_scatter_copy(mesh: Mesh) -> dict | None:
    """Peak resident growth while an async reduce-scatter of a 64 MiB bucket is in flight, with the bucket as the
    op's scratch (what the data-parallel buckets ask for) and without (gloo's own op clones it); and likewise for
    the in-place all-gather of a bucket's parameters (gloo's own gathers into a flat copy of the output); CPU
    only."""
    from megaloom.training.dryrun import return_freed_memory
    from tests.checkpoint.sharded_worlds import PeakGrowth

    if mesh.device.type != "cpu":
        return None
    return_freed_memory()  # the resident set follows the live tensors (a freed clone leaves it)
    group, n = mesh.dp_cp_group, 16 * 2**20
    out: dict = {"bytes": 4 * n}
    for scratch in (True, False):
        bucket = torch.full((n,), float(mesh.dp_rank + 1))
        chunk = bucket.chunk(mesh.dp)[mesh.dp_rank]  # in place: the output is this rank's chunk of the bucket
        with PeakGrowth() as peak:
            comm.reduce_scatter_async(chunk, bucket, group, scratch=scratch).wait()
        out["scratch" if scratch else "copy"] = peak.bytes
        out[f"sum_ok_{scratch}"] = bool((chunk == sum(range(1, mesh.dp + 1))).all())
        bucket.fill_(-1.0)
        chunk.fill_(float(mesh.dp_rank + 1))  # each rank's updated chunk, gathered into every replica
        with PeakGrowth() as peak:
            comm.all_gather_into_async(bucket, chunk, group, scratch=scratch).wait()
        out["gather_scratch" if scratch else "gather_copy"] = peak.bytes
        want = torch.arange(1, mesh.dp + 1, dtype=torch.float32).repeat_interleave(n // mesh.dp)
        out[f"gather_ok_{scratch}"] = torch.equal(bucket, want)
        del bucket, chunk
    return out


def suite_dp4(rank: int, world: int, device: torch.device, root: str) -> dict:
    from . import onebit_worlds  # it builds on this module

    cache: dict = {}
    res: dict = {}
    mesh = Mesh.build(tiny_config(world=world), world, rank, device)
    for zero in (0, 1, 2, 3):
        res[f"dp4-z{zero}"] = dp_case(mesh, zero, cache=cache)
    res["dp4-z2-clip"] = dp_case(mesh, 2, clip=0.05, cache=cache)
    res["dp4-z1-lamb"] = dp_case(mesh, 1, "lamb", cache=cache)
    tp = Mesh.build(tiny_config(tp=2, world=world), world, rank, device)
    for zero in (0, 1, 2, 3):
        res[f"tp2dp2-z{zero}"] = dp_case(tp, zero, clip=0.05, cache=cache)
    res["tp2dp2-z1-sp"] = dp_case(tp, 1, sp=True, cache=cache)
    res["tp2dp2-z1-sp-fused"] = dp_case(tp, 1, sp=True, cache=cache, fused=True)
    res["tp2dp2-z1-sp-fused-untied"] = dp_case(tp, 1, sp=True, cache=cache, fused=True, arch=UNTIED)
    # bf16 weights (train.bf16_params) at tp2 x dp2 + sp, fused: against one process with bf16 weights
    from .mixed_worlds import gather_dtype_case

    bf16 = torch.bfloat16
    res["bf16p-one-process"] = gather_dtype_case(Mesh.single(device), 0, bf16, low=True)
    res["tp2dp2-z1-sp-bf16p-fused"] = gather_dtype_case(tp, 1, bf16, low=True, fused=True, sp=True)
    res["tp2dp2-z0-lamb"] = dp_case(tp, 0, "lamb", cache=cache)
    res["tp2dp2-z2-lamb"] = dp_case(tp, 2, "lamb", cache=cache)
    res["tp2dp2-z1-roundtrip"] = dp_case(tp, 1, roundtrip=True, cache=cache)
    res["tp2dp2-z3-model-only"] = dp_case(tp, 3, clip=0.05, cache=cache, imported=write_imported(root, rank, device))
    # 1-bit Adam / LAMB (megaloom/optim/onebit.py) against a simulation of the same algorithm
    res["dp4-onebit_adam"] = onebit_worlds.onebit_case(mesh, "onebit_adam")
    res["dp4-onebit_lamb-clip"] = onebit_worlds.onebit_case(mesh, "onebit_lamb", clip=0.05)
    res["tp2dp2-onebit_adam-sp"] = onebit_worlds.onebit_case(tp, "onebit_adam", sp=True)
    res["dp4-onebit_adam-bf16"] = onebit_worlds.onebit_case(mesh, "onebit_adam", bf16=True)
    res["dp4-onebit_adam-refresh"] = onebit_worlds.onebit_case(mesh, "onebit_adam", refresh=onebit_worlds.REFRESH)
    res["dp4-onebit-bytes"] = onebit_worlds.bytes_case(mesh)
    res["dp4-onebit-resume"] = onebit_worlds.resume_case(mesh, "onebit_lamb", elsewhere=tp)
    return res
