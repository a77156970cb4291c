"""What the context-parallel world (4 gloo processes) runs: the distributed attention modes against full causal
attention, `Trainer` runs at several cp layouts (compared with the single process by the test), compiled blocks
at cp 2 (graph breaks and graphs counted, losses and gradients against the eager single process), and the
activation bytes a cp rank saves for backward."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megaloom.config import load_config
from megaloom.models.documents import Documents
from megaloom.models.transformer import Transformer
from megaloom.observe.saved_tensors import SavedStorages
from megaloom.parallel import comm
from megaloom.parallel.context import alltoall_attention, parallelize_context, ring_attention, shard_sequence
from megaloom.parallel.mesh import Mesh
from megaloom.parallel.tensor import gather_full_grads, gather_full_params, parallelize_tensor, sync_tp_grads
from megaloom.runtime import Runtime
from megaloom.training.trainer import Trainer
from tests.conftest import tiny_overrides
from tests.parallel.worlds import compiled_block_saves

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


# Compiled cases: name -> (cp mode, tp, kv heads, packed documents). cp 2 with dp 2 or tp 2 (+ sp) in the world of
# 4; all-to-all at tp 2 needs the kv heads to split over tp x cp (MHA).
COMPILED = {"compiled-cp2dp2-ring": ("ring", 1, 2, False), "compiled-cp2dp2-alltoall": ("alltoall", 1, 2, False),
            "compiled-cp2tp2sp-ring": ("ring", 2, 2, False), "compiled-cp2tp2sp-alltoall": ("alltoall", 2, 4, False),
            "compiled-cp2dp2-alltoall-docs": ("alltoall", 1, 4, True)}


def compiled_case(rank: int, world: int, device: torch.device, mode: str, tp: int, kv: int, docs: bool,
                  steps: int = 3) -> dict:
    """Every block of a cp 2 llama (with tp 2 + sp, or beside dp 2) compiled as train.compile does (AOTAutograd
    with the eager backend: forward and backward graphs traced and partitioned, no C++ compiler needed), against
    the same model eager on one process over the whole sequence, for ``steps`` AdamW steps on the same batches:
    graph breaks and graphs compiled (torch._dynamo's counters), the loss of every step (each rank's mean over its
    tokens, averaged over cp: the whole sequence's mean), and the first step's gradients (summed over cp / cp, as
    the data-parallel reduction over dp x cp does; gathered over tp), with the recorder a dry run installs (a
    `CommTally`, which compiled code must not call: it would split the graph). ``docs``: packed documents
    (token 0 ends one), masked by the all-to-all core."""
    over = ["model.arch=llama", "model.vocab_size=128", "model.d_model=64", "model.n_layers=2", "model.n_heads=4",
            f"model.n_kv_heads={kv}", "model.ffn_dim=128", "model.max_seq_len=32", "train.seq_len=32",
            "parallel.cp=2", f"parallel.tp={tp}", f"parallel.sp={tp > 1}", f"parallel.cp_mode={mode}",
            "train.micro_batch_size=2", f"train.global_batch_size={2 * world // (2 * tp)}"]
    cfg = load_config(None, over)
    mesh = Mesh.build(cfg, world, rank, device)
    torch.manual_seed(0)
    ref = Transformer(cfg.model)
    model = copy.deepcopy(ref)
    if tp > 1:
        model = parallelize_tensor(model, mesh, sp=True)
    parallelize_context(model, mesh, cfg)
    mesh.recorder = comm.CommTally(mesh.group_names())
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    for layer in model.layers.values():
        layer.compile(backend="aot_eager")
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.1, eps=1e-6)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, eps=1e-6)
    gen = torch.Generator().manual_seed(99)
    out: dict = {"loss": [], "loss_ref": []}
    for step in range(steps):
        tokens = torch.randint(0, 128, (2, 33), generator=gen)  # the same batch on every rank
        if docs:
            tokens[:, 5::9] = 0
            tokens[1, 3] = 0
        x, y = tokens[:, :-1], tokens[:, 1:]
        kw_ref = {"docs": Documents.from_tokens(x, 0)} if docs else {}
        kw = {"docs": kw_ref["docs"].sharded(lambda t: shard_sequence(t, 2, mesh.cp_rank))} if docs else {}
        loss_ref = ref(x, y, **kw_ref)
        loss_ref.backward()
        loss = model(shard_sequence(x, 2, mesh.cp_rank), shard_sequence(y, 2, mesh.cp_rank), **kw)
        loss.backward()
        for p in model.parameters():
            comm.all_reduce(p.grad, mesh.cp_group).div_(2)
        sync_tp_grads(model, mesh)
        if step == 0:
            grads = gather_full_grads(model, mesh)
            out["grad_err"] = {n: ((grads[n] - p.grad).abs().max().item(), p.grad.abs().max().item())
                               for n, p in ref.named_parameters()}
        out["loss"].append(comm.all_reduce(loss.detach().clone(), mesh.cp_group).item() / 2)
        out["loss_ref"].append(loss_ref.item())
        for o in (opt_ref, opt):
            o.step()
            o.zero_grad(set_to_none=True)
    counters = torch._dynamo.utils.counters
    out["graph_breaks"] = {k.splitlines()[0]: n for k, n in counters["graph_break"].items()}
    out["graphs"] = counters["stats"]["unique_graphs"]
    cp_name = mesh.recorder.name_of(mesh.cp_group)  # what the compiled core told the recorder
    out["tallied"] = {op: n for (g, op), n in mesh.recorder.calls.items() if g == cp_name}
    return out


# What compiled cp blocks save: name -> (cp mode, tp (sp with it), train.recompute_casts).
COMPILED_SAVES = {"saves-ring-tp1-lean0": ("ring", 1, False), "saves-ring-tp2sp-lean1": ("ring", 2, True),
                  "saves-alltoall-tp1-lean1": ("alltoall", 1, True),
                  "saves-alltoall-tp2sp-lean0": ("alltoall", 2, False)}


def compiled_saves_case(rank: int, world: int, device: torch.device, mode: str, tp: int, lean: bool) -> dict:
    """What one compiled block at cp 2 saves for backward under bf16 autocast (Inductor, as train.compile runs
    it; saved-tensor hooks), against the memory plan's compiled save-set: the activation bytes, neither the
    resident fp32 parameters nor their bf16 copies (which the plan counts apart), as test_world2's tp cases."""
    from megaloom.models.transformer import build_on_device
    from megaloom.planning.memory_activations import block_activation_bytes

    seq, b, sp = 40, 3, tp > 1
    over = ["model.preset=mixtral-tiny", "model.vocab_size=512", "model.moe_every=0", "model.d_model=128",
            "model.n_heads=4", f"model.n_kv_heads={4 if mode == 'alltoall' and tp > 1 else 2}", "model.ffn_dim=352",
            f"train.seq_len={seq}", f"model.max_seq_len={seq}", "parallel.cp=2", f"parallel.cp_mode={mode}",
            f"parallel.tp={tp}", f"parallel.sp={sp}", f"train.micro_batch_size={b}",
            f"train.global_batch_size={b * world // (2 * tp)}"]
    cfg = load_config(None, over)
    mesh = Mesh.build(cfg, world, rank, device)
    torch.manual_seed(0)
    model = build_on_device(cfg.model, torch.device("cpu"))
    if tp > 1:
        model = parallelize_tensor(model, mesh, sp)
    parallelize_context(model, mesh, cfg)
    block, local = model.layers["0"], seq // 2
    x = torch.randn(b, local // tp, 128, requires_grad=True)  # (tp 2 with sp: this rank's share of its tokens)
    measured, saved, graphs = compiled_block_saves(block, x, model.rope(local), lean)
    plan_cfg = load_config(None, over + ["train.compile=true", f"train.recompute_casts={str(lean).lower()}",
                                         "train.precision=bf16"])
    planned = block_activation_bytes(plan_cfg, tokens=b * local, batch=b, tp=tp, sp=sp, device="cuda",
                                     attention="flash")
    return {"measured": measured, "planned": sum(planned.values()), "saved": saved, "plan": planned,
            "graphs": graphs}


def suite_context_world4(rank: int, world: int, device: torch.device, corpus: dict, root: str) -> dict:
    res: dict = {"attention": attention_cases(rank), "activations": activation_case(rank, world, device)}
    for name, args in COMPILED.items():
        res[name] = compiled_case(rank, world, device, *args)
    for name, args in COMPILED_SAVES.items():
        res[name] = compiled_saves_case(rank, world, device, *args)
    for name, (model, extra) in CASES.items():
        res[name] = trainer_case(rank, world, device, corpus, Path(root) / name, model, extra)
    return res
