"""Multimodal (llava) cases run inside the existing worlds: tensor (+ sequence) parallel and ZeRO-1 data parallel
training of a tiny LLaVA with images against the single process. Imported by worlds.py and dp/dp_worlds.py."""

from __future__ import annotations

import copy

import torch

from megaloom.config import Config, load_config
from megaloom.models.registry import get_family
from megaloom.parallel.layout import layout_of
from megaloom.parallel.mesh import Mesh
from megaloom.parallel.tensor import (
    gather_full_grads,
    gather_full_params,
    gather_vocab_logits,
    parallelize_tensor,
    sync_tp_grads,
)

from .full_state import sharded_model_state
from .grad_compare import first_step_grads

VOCAB, SEQ, IMAGE_ID, IMAGE, PATCH, SLOTS = 128, 16, 127, 16, 8, 2
PER_IMAGE = (IMAGE // PATCH) ** 2


def llava_config(tp: int = 1, sp: bool = False, world: int = 1, freeze: str = "") -> Config:
    return load_config(None, [
        "model.preset=llava-tiny", f"model.vocab_size={VOCAB}", "model.d_model=64", "model.n_layers=2",
        "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=128", f"model.max_seq_len={SEQ}",
        "model.vision_layers=2", "model.vision_d_model=32", "model.vision_heads=4", "model.vision_ffn_dim=64",
        f"model.image_size={IMAGE}", f"model.patch_size={PATCH}", f"model.image_token_id={IMAGE_ID}",
        "model.vision_act=quick_gelu", f"model.freeze={freeze}", f"train.seq_len={SEQ}", f"parallel.tp={tp}",
        f"parallel.sp={sp}", "train.micro_batch_size=1", f"train.global_batch_size={max(world // tp, 1)}"])


def llava_model(cfg: Config, device: torch.device):
    torch.manual_seed(1234)
    model = get_family("llava").build(cfg.model).to(device)
    with torch.no_grad():  # norms and biases off their init, so a misplaced one shows
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model


def llava_batches(rows: int, steps: int, device: torch.device, seed: int = 99) -> list[dict]:
    """Rows of SEQ + 1 tokens, the first row with one image, the others two (at varied places); labels masked on
    the image tokens (-100)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, IMAGE_ID, (rows, SEQ + 1), generator=gen)
        n = torch.full((rows,), 2)
        n[0] = 1
        for r in range(rows):
            starts = [1 + r % 3] if r == 0 else [1 + r % 3, 8]
            for s in starts:
                tokens[r, s:s + PER_IMAGE] = IMAGE_ID
        images = torch.randn(rows, SLOTS, 3, IMAGE, IMAGE, generator=gen)
        labels = tokens[:, 1:].masked_fill(tokens[:, 1:] == IMAGE_ID, -100)
        out.append({"x": tokens[:, :-1].to(device), "y": labels.to(device), "images": images.to(device),
                    "n_images": n.to(device)})
    return out


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def llava_parity_case(mesh: Mesh, sp: bool, steps: int = 5) -> dict:
    """parity_case's measurements (tests/parallel/checks.assert_parity) for a LLaVA with images at tp (+sp)."""
    cfg = llava_config(tp=mesh.tp, sp=sp, world=mesh.world_size)
    ref = llava_model(cfg, mesh.device)
    model = parallelize_tensor(copy.deepcopy(ref), mesh, sp)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.1, eps=1e-6)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, eps=1e-6)
    out: dict = dict(loss_ref=[], loss=[])
    batches = llava_batches(2, steps, mesh.device)
    for step, b in enumerate(batches):
        kw = {"images": b["images"], "n_images": b["n_images"]}
        loss_ref = ref(b["x"], b["y"], **kw)
        loss_ref.backward()
        loss = model(b["x"], b["y"], **kw)
        loss.backward()
        if step == 0:
            raw = gather_full_grads(model, mesh, synced=False)
        sync_tp_grads(model, mesh)
        if step == 0:
            out.update(first_step_grads(model, ref, mesh, raw))
            out["tied"] = model.head.weight is model.tok_emb.weight
            out["vision_split"] = {n: layout_of(p).tp_dim for n, p in model.named_parameters()
                                   if n.startswith("vision.layers.0.")}
        for o in (opt_ref, opt):
            o.step()
            o.zero_grad(set_to_none=True)
        out["loss_ref"].append(loss_ref.item())
        out["loss"].append(loss.item())
    final = gather_full_params(model, mesh)
    errs = {n: _err(final[n], p) for n, p in ref.named_parameters()}
    out["param_err"], out["param_err_at"] = max((e, n) for n, e in errs.items())
    with torch.no_grad():
        b = batches[0]
        kw = {"images": b["images"], "n_images": b["n_images"]}
        local_logits = model(b["x"], **kw)
        ref.load_state_dict({**ref.state_dict(), **final})
        out["logits_err"] = _err(gather_vocab_logits(local_logits, mesh.tp_group), ref(b["x"], **kw))
    return out


def llava_dp_case(mesh: Mesh, zero: int, freeze: str = "", steps: int = 4) -> dict:
    """ZeRO-`zero` data parallelism (one row per micro-batch, two per rank) against the single process on the
    whole global batch, with images; with ``freeze`` the frozen parts must stay out of the gradient buckets
    and the optimizer state, and keep their values."""
    from megaloom.models.freeze import freeze_parts
    from megaloom.optim.zero import ShardedOptimizer, build_data_parallel

    cfg = llava_config(world=mesh.world_size, freeze=freeze)
    rows = 2 * mesh.dp
    batches = llava_batches(rows, steps, mesh.device, seed=7)
    parts = [p for p in freeze.split(",") if p]

    ref = llava_model(cfg, mesh.device)
    freeze_parts(ref, parts)
    opt_ref = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=3e-3, weight_decay=0.0)
    ref_loss = []
    for b in batches:
        total = 0.0
        for r in range(rows):  # one row per micro-batch: the mean of the rows' means
            loss = ref(b["x"][r:r + 1], b["y"][r:r + 1], images=b["images"][r:r + 1],
                       n_images=b["n_images"][r:r + 1]) / rows
            loss.backward()
            total += loss.item()
        opt_ref.step()
        opt_ref.zero_grad(set_to_none=True)
        ref_loss.append(total)

    model = llava_model(cfg, mesh.device)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    freeze_parts(model, parts)
    grads = build_data_parallel(model, mesh, zero, 0.05)
    opt = ShardedOptimizer(grads, "adamw", lr=3e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    losses = []
    for b in batches:
        mine = range(mesh.dp_rank * 2, mesh.dp_rank * 2 + 2)
        total = torch.zeros((), device=mesh.device)
        for i, r in enumerate(mine):
            if i == 1:
                grads.start_last_microbatch()
            loss = model(b["x"][r:r + 1], b["y"][r:r + 1], images=b["images"][r:r + 1],
                         n_images=b["n_images"][r:r + 1]) / 2
            loss.backward()
            total += loss.detach()
        grads.finish()
        grads.clip(float("inf"))
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.distributed.all_reduce(total, group=mesh.dp_cp_group)
        losses.append(total.item() / mesh.dp)
    final = sharded_model_state(opt)
    ref_params = dict(ref.named_parameters())
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    return dict(loss=losses, ref_loss=ref_loss,
                param_err=max((final[n] - p).abs().max().item() for n, p in ref_params.items()),
                trainable=trainable, bucketed=sorted(n for n, _ in grads.named_params),
                bucket_elements=sum(p.numel() for _, p in grads.named_params),
                state_bytes=opt.state_bytes(),
                frozen_unchanged=all(torch.equal(final[n], initial[n]) for n in initial if n not in trainable),
                grads_of_frozen=[n for n, p in model.named_parameters() if not p.requires_grad and p.grad is not None])


def llava_image_text_batch(rows: int, seed: int):
    """An `ImageTextBatch` as the loader makes it (image tokens not targets) from `llava_batches`' rows."""
    from megaloom.data.image_text.batch import ImageTextBatch

    b = llava_batches(rows, 1, torch.device("cpu"), seed=seed)[0]
    tokens = torch.cat([b["x"], b["y"][:, -1:].clamp(min=0)], dim=1)
    return ImageTextBatch(tokens, tokens != IMAGE_ID, b["images"], b["n_images"])


def llava_pipeline_case(mesh: Mesh, emb_group, schedule: str, m: int, steps: int = 3) -> dict:
    """pp=2 with the image encoder and projector on the first stage (the images travel with its micro-batches,
    the masked labels with the last stage's) against the single process: losses, every gradient of step 1,
    the clipped norm over both stages, and a forward-only evaluation."""
    from megaloom.parallel.pipeline.executor import PipelineExecutor
    from megaloom.parallel.pipeline.grads import PipelineGradientSync
    from megaloom.parallel.pipeline.partition import partition_layers
    from megaloom.parallel.pipeline.schedules import build_schedule, forward_only
    from megaloom.parallel.pipeline.stage import build_stage

    cfg = llava_config(world=mesh.world_size)
    ref = llava_model(cfg, mesh.device)
    stage = build_stage(copy.deepcopy(ref), partition_layers(cfg.model.n_layers, mesh.pp), mesh)
    ex = PipelineExecutor(stage, build_schedule(schedule, mesh.pp, 1, m), mesh, 1, SEQ)
    sync = PipelineGradientSync(stage, mesh, emb_group)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.1)
    opt = torch.optim.AdamW(stage.parameters(), lr=3e-3, weight_decay=0.1)
    out: dict = dict(loss=[], loss_ref=[], norm=[], norm_ref=[], first_stage_has_vision=stage.has_embedding
                     and stage.model.vision is not None, names=[n for n, _ in stage.model.named_parameters()])
    for step in range(steps):
        batch = llava_image_text_batch(m, seed=step).to(mesh.device)
        total = 0.0
        for x, y, kw in batch.micro_inputs(1):
            loss = ref(x, y, **kw) / m
            loss.backward()
            total += loss.item()
        ref_grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
        out["norm_ref"].append(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5).item())
        loss = ex.run(batch)
        sync.finish()
        if step == 0:
            grads = gather_full_grads(stage.model, mesh)
            out["grad_err"] = {n: (_err(g, ref_grads[n if n in ref_grads else "tok_emb.weight"]),
                                   torch.allclose(g, ref_grads[n if n in ref_grads else "tok_emb.weight"],
                                                  rtol=1e-4, atol=1e-5)) for n, g in grads.items()}
        out["norm"].append(sync.clip(0.5).item())
        for o in (opt_ref, opt):
            o.step()
            o.zero_grad(set_to_none=True)
        out["loss_ref"].append(total)
        out["loss"].append(loss.item())
    ev = PipelineExecutor(stage, forward_only(mesh.pp, 1, m), mesh, 1, SEQ)
    batch = llava_image_text_batch(m, seed=50).to(mesh.device)
    with torch.no_grad():
        ref_eval = sum(ref(x, y, **kw).item() for x, y, kw in batch.micro_inputs(1)) / m
        out["eval"] = (ev.run(batch).item(), ref_eval)
    return out


def llava_pipeline_frozen_case(mesh: Mesh, emb_group, steps: int = 3) -> dict:
    """pp=2 in projector-only pretraining (vision and language frozen), wired as the trainer wires it (freeze,
    then the stage cut, then the gradient buckets with the tied embedding): the last stage then holds no trainable
    parameter at all. Losses against the single process, no gradients or buckets for frozen parameters."""
    from megaloom.models.freeze import freeze_parts
    from megaloom.parallel.data_parallel import DataParallelGrads
    from megaloom.parallel.pipeline.executor import PipelineExecutor
    from megaloom.parallel.pipeline.partition import partition_layers
    from megaloom.parallel.pipeline.schedules import build_schedule
    from megaloom.parallel.pipeline.stage import build_stage, tied_parameter

    cfg = llava_config(world=mesh.world_size, freeze="vision,language")
    ref = llava_model(cfg, mesh.device)
    model = copy.deepcopy(ref)
    for m in (ref, model):
        freeze_parts(m, ["vision", "language"])
    stage = build_stage(model, partition_layers(cfg.model.n_layers, mesh.pp), mesh)
    grads = DataParallelGrads(stage.model, mesh, 0, 0.05, tied=tied_parameter(stage), tied_group=emb_group)
    ex = PipelineExecutor(stage, build_schedule("1f1b", mesh.pp, 1, 2), mesh, 1, SEQ)
    trainable = [p for p in stage.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=3e-3) if trainable else None
    opt_ref = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=3e-3)
    before = {n: p.detach().clone() for n, p in stage.model.named_parameters()}
    out: dict = dict(loss=[], loss_ref=[])
    for step in range(steps):
        batch = llava_image_text_batch(2, seed=step).to(mesh.device)
        total = 0.0
        for x, y, kw in batch.micro_inputs(1):
            loss = ref(x, y, **kw) / 2
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_([p for p in ref.parameters() if p.requires_grad], 0.5)
        loss = ex.run(batch)
        grads.finish()
        grads.clip(0.5)
        out["frozen_grads"] = [n for n, p in stage.model.named_parameters()
                               if not p.requires_grad and p.grad is not None]
        for o in (opt_ref, opt):
            if o is not None:
                o.step()
                o.zero_grad(set_to_none=True)
        out["loss_ref"].append(total)
        out["loss"].append(loss.item())
    out["trainable"] = sorted(n for n, p in stage.model.named_parameters() if p.requires_grad)
    out["bucketed"] = sorted(n for n, _ in grads.named_params)
    out["changed"] = sorted(n for n, p in stage.model.named_parameters() if not torch.equal(p, before[n]))
    return out
