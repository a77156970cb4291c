"""What the ranks of the ZeRO x pipeline world run (see test_zero_pp_world.py): numbers, not assertions.

Each case trains the same tiny model with megaloom.step.TrainStep twice on every rank: the reference (the full
model on the global batch, one process's gradient accumulation, clipping and optimizer) and the layout (pipeline
stage + schedule executor + DataParallelGrads buckets reduced over dp as each chunk finishes, ZeRO 0/1/2 with
the sharded optimizer), and reports both loss and norm curves, the final weights' largest difference, the
collectives issued on the data-parallel group, and what the buckets did.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import torch
import torch.distributed as dist

from megaloom.checkpoint.store import load_checkpoint, save_checkpoint
from megaloom.config import Config, load_config
from megaloom.data.objective import inputs_and_labels
from megaloom.models import Transformer
from megaloom.models.lora import is_adapter_name
from megaloom.optim.lamb import build_lamb
from megaloom.optim.muon import ShardedMuon, build_muon
from megaloom.optim.onebit import KINDS, PAD_MULTIPLE, OnebitOptimizer
from megaloom.optim.param_groups import param_groups
from megaloom.optim.zero import ShardedOptimizer, build_data_parallel
from megaloom.parallel import comm
from megaloom.parallel.expert import is_expert_param
from megaloom.parallel.layout import single_model_name
from megaloom.parallel.mesh import Mesh
from megaloom.parallel.pipeline.executor import PipelineExecutor
from megaloom.parallel.pipeline.partition import partition_layers
from megaloom.parallel.pipeline.schedules import build_schedule
from megaloom.parallel.pipeline.stage import build_embedding_groups, build_stage, tied_parameter
from megaloom.parallel.tensor import gather_full_params, parallelize_tensor
from megaloom.step import TrainStep

from ..lora_setup import freeze_base, randomize_adapters, with_lora

VOCAB, SEQ, MICRO = 128, 16, 2
CLIP, LR, WD, BETAS = 0.5, 3e-3, 0.1, (0.9, 0.95)
EPS = {"adamw": 1e-8, "lamb": 1e-6, "onebit_adam": 1e-8, "onebit_lamb": 1e-6}
ONEBIT_WARMUP = 2
BUCKET_MB = 0.02  # ~5k fp32 elements: the tiny stage spreads over several buckets


def config(pp: int, tp: int = 1, vpp: int = 1, sp: bool = False, ep: int = 1, n_layers: int = 4,
           arch: str = "llama", tie: bool = True, world: int = 4, moe: bool = False, lora: bool = False) -> Config:
    dp = world // (tp * pp)
    extra = ["model.moe_every=2", "model.n_experts=4", "model.top_k=2", "model.n_shared_experts=1",
             "model.expert_ffn_dim=32", "model.capacity_factor=0", "model.aux_loss_weight=0.01"] if moe else []
    cfg = load_config(None, [
        f"model.arch={arch}", f"model.vocab_size={VOCAB}", "model.d_model=64", f"model.n_layers={n_layers}",
        "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=128", f"model.max_seq_len={SEQ}",
        f"model.tie_embeddings={tie}", f"train.seq_len={SEQ}", f"parallel.tp={tp}", f"parallel.pp={pp}",
        f"parallel.vpp={vpp}", f"parallel.sp={sp}", f"parallel.ep={ep}", f"train.micro_batch_size={MICRO}",
        f"train.global_batch_size={MICRO * dp}", *extra])
    return with_lora(cfg) if lora else cfg


class Log(comm.OpRecorder):
    """Every collective issued (name, group name, bytes) in order; ``wait`` entries mark completions."""

    def __init__(self, names: dict) -> None:
        self.names, self.events = names, []

    def enter(self, name: str, group, nbytes: int = 0) -> None:
        self.events.append((name, self.names.get(group, "other"), nbytes))


def optimizer(model, grads, zero: int, kind: str, mesh: Mesh | None, whole_modules=()):
    if kind == "muon":  # Newton-Schulz in fp32: parity (tests/parallel/muon_worlds.py)
        if zero:
            return ShardedMuon(grads, lr=LR, betas=BETAS, weight_decay=WD, ns_dtype=torch.float32,
                               whole_modules=whole_modules)
        return build_muon(model, mesh or Mesh.single(next(model.parameters()).device), LR, WD, BETAS,
                          ns_dtype=torch.float32)
    if kind in KINDS:  # 1-bit Adam / LAMB over the buckets (zero 0)
        return OnebitOptimizer(model, grads, KINDS[kind], lr=LR, betas=BETAS, eps=EPS[kind], weight_decay=WD,
                               warmup_steps=ONEBIT_WARMUP)
    if zero:
        return ShardedOptimizer(grads, kind, lr=LR, betas=BETAS, eps=EPS[kind], weight_decay=WD,
                                whole_modules=whole_modules)
    if kind == "lamb":
        return build_lamb(model, WD, LR, BETAS, EPS["lamb"], mesh=mesh)
    return torch.optim.AdamW(param_groups(model, WD), lr=LR, betas=BETAS, eps=EPS[kind], foreach=True)


def batches(mesh: Mesh, m: int, steps: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(99)
    return [torch.randint(0, VOCAB, (mesh.dp * m * MICRO, SEQ + 1), generator=gen).to(mesh.device)
            for _ in range(steps)]


def reference(cfg: Config, kind: str, data: list[torch.Tensor], device, cache: dict, clip: float = CLIP) -> dict:
    """The single process on the global batches (cached per model / optimizer)."""
    key = (cfg.model.arch, cfg.model.n_layers, cfg.model.tie_embeddings, cfg.model.moe_every, kind, len(data),
           data[0].shape[0], cfg.model.lora.rank, clip)
    if key not in cache:
        torch.manual_seed(1234)
        ref = Transformer(cfg.model).to(device)
        if cfg.model.lora.rank:  # LoRA: non-zero adapters on every linear, the base frozen
            randomize_adapters(ref)
        base = copy.deepcopy(ref)
        freeze_base(ref, cfg)
        step = TrainStep(ref, optimizer(ref, None, 0, kind, None), "fp32", device, MICRO, clip)
        out = [step(b) for b in data]
        cache[key] = dict(base=base, loss=[o.loss.item() for o in out], norm=[o.grad_norm.item() for o in out],
                          params={n: p.detach().clone() for n, p in ref.named_parameters()})
    return cache[key]


class Layout:
    """One layout's model, gradients, optimizer and step on this rank."""

    def __init__(self, base: Transformer, cfg: Config, mesh: Mesh, emb_group, schedule: str, m: int, zero: int,
                 kind: str, bucket_mb: float = BUCKET_MB, gather_dtype: torch.dtype = torch.float32,
                 compiled: bool = False, clip: float = CLIP) -> None:
        """``compiled``: every block compiled as the trainer does with train.compile (dynamo's eager backend:
        the same tracing and hooks, no C++ compiler needed), its parameters waited for by one hook per block."""
        p = cfg.parallel
        model = parallelize_tensor(copy.deepcopy(base), mesh, p.sp)
        freeze_base(model, cfg)  # model.lora / model.freeze, after the split as the trainer does
        self.stage = build_stage(model, partition_layers(cfg.model.n_layers, mesh.pp, p.vpp), mesh)
        self.model = self.stage.model
        self.blocks = list(self.model.layers.values()) if compiled else []
        for block in self.blocks:
            block.compile(backend="eager")
        self.ex = PipelineExecutor(self.stage, build_schedule(schedule, mesh.pp, p.vpp, m), mesh, MICRO, SEQ,
                                   sp=p.sp, inputs_and_labels=inputs_and_labels)
        self.grads = build_data_parallel(self.model, mesh, zero, bucket_mb, gather_dtype,
                                         tied=tied_parameter(self.stage), tied_group=emb_group,
                                         pad_multiple=PAD_MULTIPLE if kind in KINDS else 1)
        self.opt = optimizer(self.model, self.grads, zero, kind, mesh, whole_modules=self.blocks)
        self.step = TrainStep(self.model, self.opt, "fp32", mesh.device, MICRO, clip, self.grads, pipeline=self.ex)
        self.mesh = mesh

    def run(self, data: list[torch.Tensor]) -> tuple[list[float], list[float]]:
        mesh, losses, norms = self.mesh, [], []
        rows = data[0].shape[0] // mesh.dp
        feeds = self.stage.has_embedding or self.stage.has_head
        for batch in data:
            mine = batch[mesh.dp_rank * rows:(mesh.dp_rank + 1) * rows]
            out = self.step(mine if feeds else None)
            loss = comm.all_reduce(out.loss.clone(), mesh.dp_cp_group) / mesh.dp  # the global-batch mean
            losses.append(loss.item())
            norms.append(out.grad_norm.item())
        return losses, norms

    def param_err(self, ref_params: dict[str, torch.Tensor]) -> float:
        self.model.state_dict()  # waits for parameter all-gathers in flight
        full = gather_full_params(self.model, self.mesh)
        params = dict(self.model.named_parameters())
        return max((full[n] - ref_params[single_model_name(n, params[n])]).abs().max().item() for n in full)


def zero_pp_case(mesh: Mesh, emb_group, cache: dict, schedule: str = "1f1b", m: int = 4, zero: int = 1,
                 kind: str = "adamw", steps: int = 4, clip: float = CLIP, **model_kw) -> dict:
    """``clip``: below the case's gradient norms (an adapters-only norm is smaller than a whole model's)."""
    cfg = config(mesh.pp, mesh.tp, world=mesh.world_size, ep=mesh.ep, **model_kw)
    data = batches(mesh, m, steps)
    ref = reference(cfg, kind, data, mesh.device, cache, clip)
    names = {mesh.dp_cp_group: "dp", mesh.pp_group: "pp", mesh.tp_group: "tp", emb_group: "emb"}
    if mesh.ep > 1:
        names[mesh.edp_group] = "edp"
    log = Log(names)
    mesh.recorder = log
    try:
        lay = Layout(ref["base"], cfg, mesh, emb_group if cfg.model.tie_embeddings else None, schedule, m, zero, kind,
                     clip=clip)
        log.events.clear()
        loss, norm = lay.run(data)
    finally:
        mesh.recorder = comm.NullRecorder()
    buckets = lay.grads.buckets
    before = dict(ref["base"].named_parameters())  # LoRA: the frozen base bit-identical after the steps
    base_changed = [n for n, p in lay.model.named_parameters() if cfg.model.lora.rank and not is_adapter_name(n)
                    and not (p.grad is None and torch.equal(p.detach(), before[single_model_name(n, p)]))]
    return dict(loss=loss, loss_ref=ref["loss"], norm=norm, norm_ref=ref["norm"], base_changed=base_changed, clip=clip,
                param_err=lay.param_err(ref["params"]), events=log.events, stats=lay.grads.stats.as_dict(),
                n_buckets=len(buckets),
                bucket_bytes=[b.padded * 4 for b in buckets], bucket_ranks=[b.size for b in buckets],
                tied_bucket=[b.tied for b in buckets],
                model_bytes=sum(p.numel() * 4 for p in lay.model.parameters()),
                shard_numel=lay.grads.shard_numel(), numel=sum(p.numel() for p in lay.model.parameters()))


def onebit_case(mesh: Mesh, emb_group, cache: dict, kind: str = "onebit_adam", steps: int = 6, **model_kw) -> dict:
    """1-bit Adam / LAMB through the pipeline executor and TrainStep at pp2 x dp2 (MoE: ep2 too): the collectives
    on the data-parallel group per step, whether the dp replicas (and the tied embedding's two copies) hold the
    same weights, and the loss next to plain AdamW's single process."""
    cfg = config(mesh.pp, mesh.tp, world=mesh.world_size, ep=mesh.ep, **model_kw)
    data = batches(mesh, 4, steps)
    ref = reference(cfg, "adamw", data, mesh.device, cache)
    names = {mesh.dp_cp_group: "dp", mesh.pp_group: "pp", mesh.tp_group: "tp", emb_group: "emb"}
    if mesh.ep > 1:
        names[mesh.edp_group] = "edp"
    lay = Layout(ref["base"], cfg, mesh, emb_group, "1f1b", 4, 0, kind)
    ops: list[list[str]] = []

    class Ops(comm.OpRecorder):
        def enter(self, name, group, nbytes=0):
            if names.get(group) in ("dp", "edp") and not name.startswith("wait "):
                ops[-1].append(name)

    mesh.recorder = Ops()
    losses = []
    try:
        for b in data:
            ops.append([])
            losses += lay.run([b])[0]
    finally:
        mesh.recorder = comm.NullRecorder()
    dense = [p for p in lay.model.parameters() if not is_expert_param(p)]
    mine = torch.cat([p.detach().reshape(-1) for p in dense])
    replica = (comm.all_reduce(mine.clone(), mesh.dp_cp_group, op="max") - mine).abs().max().item()
    tied = tied_parameter(lay.stage)
    tied_err = None
    if tied is not None:  # the embedding on the first stage, the head's copy on the last: the same after the steps
        other = comm.all_reduce(tied.detach().clone(), emb_group, op="max")
        tied_err = (other - tied.detach()).abs().max().item()
    return dict(loss=losses, loss_ref=ref["loss"], ops=ops, replica_err=replica, tied_err=tied_err,
                warmup=ONEBIT_WARMUP, compressed=[ex is not None for ex in lay.opt.exchanges],
                bucket_ranks=[b.size for b in lay.grads.buckets], finite=is_finite(losses))


def checkpoint_case(rank: int, mesh: Mesh, emb_group, cache: dict, root: str, world: int) -> dict:
    """Save after 3 steps at pp2 x vpp2 x dp2 ZeRO-1, load into other layouts (pp2 ZeRO-2 with other buckets, pp2
    ZeRO-0, pp=1 x dp4 ZeRO-1; the test process loads it into one process) and continue: the reference's losses
    of steps 4-5."""
    cfg = config(mesh.pp, vpp=2, world=world)
    data = batches(mesh, 4, 5)
    ref = reference(cfg, "adamw", data, mesh.device, cache)
    src = Layout(ref["base"], cfg, mesh, emb_group, "interleaved", 4, 1, "adamw")
    src.run(data[:3])
    path = save_checkpoint(Path(root) / "ckpt", 3, src.model, src.opt, {}, keep=2, rank=rank, barrier=dist.barrier,
                           mesh=mesh)
    out: dict = {"ref": ref["loss"][3:]}
    for name, zero, bucket in (("pp2-z2", 2, 0.01), ("pp2-z0", 0, BUCKET_MB)):
        dst = Layout(ref["base"], config(mesh.pp, world=world), mesh, emb_group, "1f1b", 4, zero, "adamw", bucket)
        load_checkpoint(path, dst.model, dst.opt, rank=rank, mesh=mesh)
        out[name] = dst.run(data[3:])[0]
    # pp = 1, dp = 4, ZeRO-1: the same global batches, 4 rows per replica.
    flat = Mesh.build(config(1, world=world), world, rank, mesh.device)
    model = parallelize_tensor(copy.deepcopy(ref["base"]), flat, False)
    grads = build_data_parallel(model, flat, 1, BUCKET_MB)
    opt = optimizer(model, grads, 1, "adamw", flat)
    load_checkpoint(path, model, opt, rank=rank, mesh=flat)
    step = TrainStep(model, opt, "fp32", flat.device, MICRO, CLIP, grads)
    losses = []
    for batch in data[3:]:
        rows = batch.shape[0] // flat.dp
        o = step(batch[flat.dp_rank * rows:(flat.dp_rank + 1) * rows])
        losses.append((comm.all_reduce(o.loss.clone(), flat.dp_cp_group) / flat.dp).item())
    out["dp4-z1"] = losses
    return out


def gather_bytes_case(mesh: Mesh, emb_group, cache: dict, gather_dtype: torch.dtype, compiled: bool = False) -> dict:
    """Bytes per step per group with the parameter all-gathers in ``gather_dtype`` (pp2 x dp2 ZeRO-1), the order of
    the gathers against the next forward's computation, and the loss curve. ``compiled``: blocks compiled."""
    cfg = config(mesh.pp, world=mesh.world_size)
    data = batches(mesh, 4, 3)
    ref = reference(cfg, "adamw", data, mesh.device, cache)
    lay = Layout(ref["base"], cfg, mesh, emb_group, "1f1b", 4, 1, "adamw", gather_dtype=gather_dtype,
                 compiled=compiled)
    tally = comm.CommTally({mesh.dp_cp_group: "dp", mesh.pp_group: "pp", emb_group: "emb"})
    order: list[tuple] = []

    class Both(comm.OpRecorder):
        def enter(self, name, group, nbytes=0):
            tally.enter(name, group, nbytes)
            order.append(("comm", name, tally.name_of(group)))

    @torch.compiler.disable  # runs when the module is called, also before a compiled block's graph
    def mark(module, args, name=None):
        order.append(("forward", name))

    inside = {id(sub) for b in lay.blocks for sub in b.modules() if sub is not b}
    hooks = [mod.register_forward_pre_hook(lambda mod, args, n=n: mark(mod, args, n))
             for n, mod in lay.model.named_modules()
             if id(mod) not in inside and (list(mod.parameters(recurse=False)) or mod in lay.blocks)]
    from torch._dynamo.utils import counters

    counters.clear()
    mesh.recorder = Both()
    try:
        loss, _ = lay.run(data[:1])  # the first step's gather is in flight when it returns
        tally.reset()
        order.clear()
        more, _ = lay.run(data[1:])
    finally:
        mesh.recorder = comm.NullRecorder()
        for h in hooks:
            h.remove()
    return dict(rows=tally.rows(), order=order, loss=loss + more, loss_ref=ref["loss"],
                param_dtype=str(next(lay.model.parameters()).dtype), n_buckets=len(lay.grads.buckets),
                numel=sum(b.padded for b in lay.grads.buckets),
                master_dtype=str(lay.opt.tensors[0].dtype), separate=lay.opt.separate_masters,
                # graph breaks at the parameter waits (the test's own `mark` hooks break at each block's start)
                wait_breaks=sum(n for why, n in counters["graph_break"].items() if "_WaitForParams" in why))


def suite_zero_pp_world4(rank: int, world: int, device: torch.device, root: str) -> dict:
    res: dict = {}
    cache: dict = {}
    mesh = Mesh.build(config(pp=2, world=world), world, rank, device)  # pp2 x dp2
    emb = build_embedding_groups(mesh)
    for zero in (0, 1, 2):
        res[f"pp2dp2-1f1b-z{zero}"] = zero_pp_case(mesh, emb, cache, "1f1b", zero=zero)
    res["pp2dp2-zb-z1"] = zero_pp_case(mesh, emb, cache, "zb", zero=1)
    res["pp2dp2-zb-z2"] = zero_pp_case(mesh, emb, cache, "zb", zero=2)
    res["pp2dp2-gpipe-z2"] = zero_pp_case(mesh, emb, cache, "gpipe", zero=2)
    res["pp2dp2-vpp2-z1"] = zero_pp_case(mesh, emb, cache, "interleaved", zero=1, vpp=2)
    res["pp2dp2-vpp2-z2"] = zero_pp_case(mesh, emb, cache, "interleaved", zero=2, vpp=2)
    res["pp2dp2-1f1b-z1-untied"] = zero_pp_case(mesh, emb, cache, "1f1b", zero=1, tie=False)
    res["pp2dp2-1f1b-z1-lamb"] = zero_pp_case(mesh, emb, cache, "1f1b", zero=1, kind="lamb")
    res["pp2dp2-1f1b-z2-gpt2"] = zero_pp_case(mesh, emb, cache, "1f1b", zero=2, arch="gpt2")
    # LoRA: only the adapters in the buckets and ZeRO-1's shards; the frozen tied embedding has no bucket
    res["pp2dp2-1f1b-z1-lora"] = zero_pp_case(mesh, emb, cache, "1f1b", zero=1, lora=True, clip=0.2,
                                              steps=3)
    res["ckpt"] = checkpoint_case(rank, mesh, emb, cache, root, world)
    res["gather-fp32"] = gather_bytes_case(mesh, emb, cache, torch.float32)
    res["gather-bf16"] = gather_bytes_case(mesh, emb, cache, torch.bfloat16)
    res["gather-bf16-compiled"] = gather_bytes_case(mesh, emb, cache, torch.bfloat16, compiled=True)
    res["pp2dp2-onebit_adam"] = onebit_case(mesh, emb, cache)
    res["pp2dp2-onebit_lamb"] = onebit_case(mesh, emb, cache, "onebit_lamb")
    mesh = Mesh.build(config(pp=2, ep=2, world=world, moe=True), world, rank, device)  # pp2 x dp2 (ep2)
    emb = build_embedding_groups(mesh)
    for zero in (0, 1, 2):
        res[f"pp2dp2ep2-moe-z{zero}"] = zero_pp_case(mesh, emb, cache, "1f1b", zero=zero, moe=True)
    res["pp2dp2ep2-moe-vpp2-z1"] = zero_pp_case(mesh, emb, cache, "interleaved", zero=1, moe=True, vpp=2)
    res["pp2dp2ep2-moe-onebit_adam"] = onebit_case(mesh, emb, cache, moe=True)
    return res


def suite_zero_pp_world8(rank: int, world: int, device: torch.device) -> dict:
    res: dict = {}
    cache: dict = {}
    mesh = Mesh.build(config(pp=2, tp=2, sp=True, world=world), world, rank, device)  # pp2 x dp2 x tp2
    emb = build_embedding_groups(mesh)
    res["pp2dp2tp2-sp-1f1b-z1"] = zero_pp_case(mesh, emb, cache, "1f1b", zero=1, sp=True)
    res["pp2dp2tp2-sp-vpp2-z2"] = zero_pp_case(mesh, emb, cache, "interleaved", zero=2, sp=True, vpp=2)
    res["pp2dp2tp2-zb-z1-lamb"] = zero_pp_case(mesh, emb, cache, "zb", zero=1, kind="lamb")
    mesh = Mesh.build(config(pp=2, ep=2, world=world, moe=True), world, rank, device)  # pp2 x dp4 (ep2, edp2)
    emb = build_embedding_groups(mesh)
    res["pp2dp4ep2-moe-z1"] = zero_pp_case(mesh, emb, cache, "1f1b", zero=1, moe=True)
    res["pp2dp4ep2-moe-z2"] = zero_pp_case(mesh, emb, cache, "zb", zero=2, moe=True)
    return res


def is_finite(xs: list[float]) -> bool:
    return all(math.isfinite(x) for x in xs)
