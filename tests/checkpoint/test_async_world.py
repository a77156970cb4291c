"""Asynchronous saving in a world of 2 ranks (gloo, tp=2): each rank's writer thread writes its own shards
(on the checkpoint's own process group), every rank writes its RNG file, and the result loads at tp=2 and tp=1."""

from __future__ import annotations

import json
import os
import tempfile
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megaloom.checkpoint import load_checkpoint
from megaloom.checkpoint.async_save import AsyncCheckpointer
from megaloom.config import load_config
from megaloom.models import Transformer
from megaloom.parallel.mesh import Mesh
from megaloom.parallel.tensor import parallelize_tensor, sync_tp_grads
from tests.parallel.full_state import full_model_state, full_optim_state

SETTINGS = ["model.vocab_size=64", "model.d_model=32", "model.n_layers=1", "model.n_heads=2",
            "model.n_kv_heads=2", "model.ffn_dim=64", "train.seq_len=8", "model.max_seq_len=8",
            "train.micro_batch_size=1", "train.global_batch_size=1"]


def _build(tp: int, rank: int, world: int):
    cfg = load_config(None, [*SETTINGS, f"parallel.tp={tp}"])
    mesh = Mesh.build(cfg, world, rank, "cpu") if world > 1 else Mesh.single()
    torch.manual_seed(0)
    model = parallelize_tensor(Transformer(cfg.model), mesh, sp=False)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2), mesh


def _rank(rank: int, world: int, tmp: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/init", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        model, opt, mesh = _build(2, rank, world)
        x = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(1))
        model(x, x).backward()
        sync_tp_grads(model, mesh)
        opt.step()
        ckpt = AsyncCheckpointer()
        root = Path(tmp) / "checkpoints"
        ckpt.save(root, 1, model, opt, {}, keep=2, rank=rank, barrier=dist.barrier, mesh=mesh)
        model(x, x).backward()  # the loop (and its collectives) goes on while the writers write
        sync_tp_grads(model, mesh)
        ckpt.wait(barrier=dist.barrier)
        model2, opt2, _ = _build(2, rank, world)  # resume at the same layout: each rank takes its shard
        load_checkpoint(root / "step_00000001", model2, opt2, rank=rank, mesh=mesh)
        same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), model2.state_dict().values(),
                                                     strict=True))
        full = {"model": full_model_state(model, mesh), "optim": full_optim_state(model, opt, mesh)}
        torch.save({"same_at_tp2": same, "full": full}, Path(tmp) / f"result{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_two_ranks_write_their_shards_and_load_at_any_layout():
    with tempfile.TemporaryDirectory(prefix="megaloom-async-world-") as tmp:
        mp.spawn(_rank, args=(2, tmp), nprocs=2, join=True)  # fresh interpreters: fork is unsafe after CUDA
        results = [torch.load(Path(tmp) / f"result{r}.pt", weights_only=True) for r in range(2)]
        assert all(r["same_at_tp2"] for r in results)
        ckpt = Path(tmp) / "checkpoints" / "step_00000001"
        manifest = json.loads((ckpt / "manifest.json").read_text())
        assert {"rng_rank0.pt", "rng_rank1.pt"} <= set(manifest)
        files = os.listdir(ckpt)  # each rank wrote its own half of every split tensor
        assert any(n.startswith("__0_") for n in files) and any(n.startswith("__1_") for n in files), files

        model, opt, _ = _build(1, 0, 1)  # resume on one process: the files are layout-free
        load_checkpoint(ckpt, model, opt)
        full = results[0]["full"]
        for k, v in model.state_dict().items():
            assert torch.equal(v, full["model"][k]), k
        names = {id(p): n for n, p in model.named_parameters()}
        for p, st in opt.state.items():
            assert torch.equal(st["exp_avg_sq"], full["optim"]["state"][names[id(p)]]["exp_avg_sq"])
