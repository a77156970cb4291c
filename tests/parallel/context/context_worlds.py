"""What the context-parallel world (4 gloo processes) runs: the distributed attention modes against full causal
attention, `Trainer` runs at several cp layouts (compared with the single process by the test), and the
activation bytes a cp rank saves for backward."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megaloom.config import load_config
from megaloom.models.transformer import Transformer
from megaloom.observe.saved_tensors import SavedStorages
from megaloom.parallel.context import alltoall_attention, parallelize_context, ring_attention, shard_sequence
from megaloom.parallel.mesh import Mesh
from megaloom.parallel.tensor import gather_full_params
from megaloom.runtime import Runtime
from megaloom.training.trainer import Trainer
from tests.conftest import tiny_overrides

BASE = ["train.steps=5", "train.seq_len=32", "train.global_batch_size=8", "train.micro_batch_size=2",
        "train.grad_clip=0.5", "checkpoint.every=0", "checkpoint.final=false", "resilience.heartbeat=false"]

# Trainer cases: name -> overrides (the reference is the same config without the parallel.* keys; `model=` picks it).
MODELS = {"gqa": [], "mha": ["model.n_kv_heads=4"], "gpt2": ["model.arch=gpt2", "model.n_kv_heads=4"],
          # DeepSeek-V3 style: latent attention (heads expanded from the latent, padded to one head size, DeepSeek's
          # softmax scale) and MoE; "mla" the same attention with dense MLPs
          "moe": ["model.preset=deepseek-v3-tiny", "model.n_kv_heads=0"],
          "mla": ["model.preset=deepseek-v3-tiny", "model.n_kv_heads=0", "model.moe_every=0"],
          # packed documents kept apart, positions restarting per document (data.document_mask/reset_positions)
          "docs": ["model.n_kv_heads=4", "data.document_mask=true", "data.reset_positions=true"],
          "gpt2-reset": ["model.arch=gpt2", "model.n_kv_heads=4", "data.reset_positions=true"]}
CASES = {
    "cp4-ring": ("gqa", ["parallel.cp=4"]),
    "cp4-alltoall": ("mha", ["parallel.cp=4", "parallel.cp_mode=alltoall"]),
    "cp2dp2-ring": ("gqa", ["parallel.cp=2", "parallel.cp_mode=ring"]),
    "cp2dp2-alltoall": ("gqa", ["parallel.cp=2", "parallel.cp_mode=alltoall"]),
    "cp2tp2sp-ring": ("gqa", ["parallel.cp=2", "parallel.tp=2", "parallel.sp=true"]),
    "cp2tp2sp-alltoall": ("mha", ["parallel.cp=2", "parallel.tp=2", "parallel.sp=true", "parallel.cp_mode=alltoall"]),
    "cp2dp2z1-ring": ("gqa", ["parallel.cp=2", "parallel.zero=1", "parallel.cp_mode=ring"]),
    "cp2dp2z1-alltoall": ("gqa", ["parallel.cp=2", "parallel.zero=1", "parallel.cp_mode=alltoall"]),
    "cp2pp2-ring": ("gqa", ["parallel.cp=2", "parallel.pp=2", "parallel.cp_mode=ring"]),
    "cp2pp2-alltoall": ("gqa", ["parallel.cp=2", "parallel.pp=2", "parallel.cp_mode=alltoall"]),
    "cp2dp2-gpt2": ("gpt2", ["parallel.cp=2"]),
    "cp2ep2-moe": ("moe", ["parallel.cp=2", "parallel.ep=2", "parallel.cp_mode=ring"]),
    "cp2tp2sp-alltoall-mla": ("mla", ["parallel.cp=2", "parallel.tp=2", "parallel.sp=true",
                                      "parallel.cp_mode=alltoall"]),
    "cp4-alltoall-docs": ("docs", ["parallel.cp=4", "parallel.cp_mode=alltoall"]),
    "cp2tp2sp-alltoall-docs": ("docs", ["parallel.cp=2", "parallel.tp=2", "parallel.sp=true",
                                        "parallel.cp_mode=alltoall"]),
    "cp2dp2-ring-reset": ("gpt2-reset", ["parallel.cp=2", "parallel.cp_mode=ring"]),
}


SHORT_DOCUMENTS = {"docs", "gpt2-reset"}  # models trained on `short_documents` (boundaries inside each sample)


def short_documents(corpus: dict, root: Path) -> dict:
    """``corpus`` plus token files of one-line documents (the lines of its source files), so that the 32-token
    samples of the document cases hold several end-of-document tokens."""
    from megaloom.data.preprocess import preprocess

    texts = root / "short"
    texts.mkdir(parents=True, exist_ok=True)
    n = 0
    for f in corpus["files"][:8]:
        lines = f.read_text().splitlines()
        for line in lines:
            chunk = line.strip()
            if len(chunk) > 8:
                (texts / f"doc{n:05d}.txt").write_text(chunk + "\n")
                n += 1
    prefix = str(root / "short-docs")
    preprocess([str(p) for p in sorted(texts.glob("*.txt"))], corpus["tokenizer"], prefix, workers=1,
               show_progress=False)
    return {**corpus, "short_prefix": prefix}


def config(corpus: dict, run_dir: Path, model: str, extra: list[str] = ()):
    data = [f"data.paths={corpus['short_prefix']}"] if model in SHORT_DOCUMENTS else []
    return load_config(None, tiny_overrides(corpus, run_dir, *BASE, *MODELS[model], *data, *extra))


def metrics(run_dir: Path) -> dict[int, dict]:
    rows = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: {"loss": r["loss"], "grad_norm": r["grad_norm"]} for r in rows}


def attention_cases(rank: int) -> dict[str, float]:
    """Max |error| of each mode's output and input gradients on this rank's tokens against full causal SDPA,
    for cp = 4 (the world) and cp = 2 (two groups), with grouped and plain heads."""
    errs: dict[str, float] = {}
    for cp, members in ((4, [[0, 1, 2, 3]]), (2, [[0, 1], [2, 3]])):
        groups = [dist.new_group(m) for m in members]  # every rank creates every group
        group, cp_rank = groups[rank // cp], rank % cp
        for heads, kv in ((4, 2), (4, 4)):
            torch.manual_seed(11)  # the same full tensors on every rank
            b, t, d = 2, 2 * cp * 6, 8
            q, k, v = (torch.randn(b, h, t, d, requires_grad=True) for h in (heads, kv, kv))
            dout = torch.randn(b, heads, t, d)
            ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=heads != kv)
            ref.backward(dout)
            for mode in ("ring", "alltoall"):
                if mode == "alltoall" and kv % cp:
                    continue
                local = [shard_sequence(x.detach(), cp, cp_rank, dim=2).requires_grad_() for x in (q, k, v)]
                fn = ring_attention if mode == "ring" else alltoall_attention
                out = fn(*local, group)
                out.backward(shard_sequence(dout, cp, cp_rank, dim=2))
                want = [ref, q.grad, k.grad, v.grad]
                got = [out] + [x.grad for x in local]
                errs[f"cp{cp}-h{heads}kv{kv}-{mode}"] = max(
                    (g - shard_sequence(w.detach(), cp, cp_rank, dim=2)).abs().max().item()
                    for g, w in zip(got, want, strict=True))
        # a layer's own softmax scale (latent attention: DeepSeek's, not 1 / sqrt(D)) reaches both modes
        for mode in ("ring", "alltoall"):
            torch.manual_seed(12)
            q, k, v = (torch.randn(2, 4, 4 * cp, 8) for _ in range(3))
            ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3)
            local = [shard_sequence(x, cp, cp_rank, dim=2) for x in (q, k, v)]
            out = (ring_attention if mode == "ring" else alltoall_attention)(*local, group, scale=0.3)
            errs[f"cp{cp}-scale-{mode}"] = (out - shard_sequence(ref, cp, cp_rank, dim=2)).abs().max().item()
    return errs


def trainer_case(rank: int, world: int, device: torch.device, corpus: dict, run_dir: Path, model: str,
                 extra: list[str]) -> dict:
    trainer = Trainer(config(corpus, run_dir, model, extra),
                      runtime=Runtime(device=device, rank=rank, world_size=world, local_rank=rank)).build()
    trainer.fit()
    mesh = trainer.mesh
    params = gather_full_params(trainer.model, mesh)  # collective over tp (and ep)
    out = {"params": params if mesh.tp_rank == 0 and mesh.cp_rank == 0 and mesh.dp_rank == 0 else {}}
    if rank == 0:
        out["metrics"] = metrics(run_dir)
    dist.barrier()
    return out


def activation_case(rank: int, world: int, device: torch.device) -> dict[str, int]:
    """Bytes saved for backward by one forward with labels: the whole sequence on one process vs this rank's
    share at cp = 4 (ring) and cp = 4 all-to-all."""
    out: dict[str, int] = {}
    tokens = torch.randint(0, 512, (2, 129), generator=torch.Generator().manual_seed(3))
    x, y = tokens[:, :-1], tokens[:, 1:]
    for mode in ("none", "ring", "alltoall"):
        over = ["model.vocab_size=512", "model.d_model=64", "model.n_layers=2", "model.n_heads=4",
                "model.n_kv_heads=4", "model.ffn_dim=128", "train.seq_len=128", "train.global_batch_size=8"]
        if mode != "none":
            over += ["parallel.cp=4", f"parallel.cp_mode={mode}"]
        cfg = load_config(None, over)
        torch.manual_seed(0)
        model = Transformer(cfg.model)
        if mode != "none":
            mesh = Mesh.build(cfg, world, rank, device)
            parallelize_context(model, mesh, cfg)
            xi, yi = shard_sequence(x, 4, mesh.cp_rank), shard_sequence(y, 4, mesh.cp_rank)
        else:
            xi, yi = x, y
        with SavedStorages(exclude=list(model.parameters()) + list(model.buffers())) as saved:
            loss = model(xi, yi)
        loss.backward()
        out[mode] = saved.activations
    return out


def suite_context_world4(rank: int, world: int, device: torch.device, corpus: dict, root: str) -> dict:
    res: dict = {"attention": attention_cases(rank), "activations": activation_case(rank, world, device)}
    for name, (model, extra) in CASES.items():
        res[name] = trainer_case(rank, world, device, corpus, Path(root) / name, model, extra)
    return res
