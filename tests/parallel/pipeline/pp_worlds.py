"""What the ranks of the pipeline world run: every case returns numbers, the tests assert on them.

Each case trains the same tiny model twice on every rank: the reference in this process (the full model,
gradient accumulation over the micro-batches as megaloom.step.TrainStep does it, clip_grad_norm_, AdamW) and
the pipeline (pipeline stage + executor + PipelineGradientSync, same optimizer), for a few steps.
"""

from __future__ import annotations

import copy

import torch

from megaloom.config import Config, load_config
from megaloom.data.objective import inputs_and_labels
from megaloom.models.registry import get_family
from megaloom.parallel import comm
from megaloom.parallel.mesh import Mesh
from megaloom.parallel.pipeline.executor import PipelineExecutor
from megaloom.parallel.pipeline.grads import PipelineGradientSync
from megaloom.parallel.pipeline.partition import partition_layers
from megaloom.parallel.pipeline.schedules import build_schedule, forward_only
from megaloom.parallel.pipeline.stage import build_embedding_groups, build_stage, tied_parameter
from megaloom.parallel.tensor import gather_full_grads, parallelize_tensor
from megaloom.step import micro_batches

from ..lora_setup import base_changed, base_params, freeze_base, randomize_adapters, with_lora
from ..worlds import MLA, MTP, arch_keys, family_arch, kv_heads, token_rows

VOCAB, SEQ, MICRO = 128, 16, 2
GEMMA = ("model.head_dim=24", "model.sliding_window=5")  # wide heads, windows shorter than the sequence
CLIP = 0.5  # below the tiny model's gradient norm, so clipping (and the norm over stages) is exercised


def pp_config(pp: int, tp: int = 1, vpp: int = 1, sp: bool = False, n_layers: int = 4, arch: str = "llama",
              tie: bool = True, world: int = 4, schedule: str = "1f1b") -> Config:
    dp = world // (tp * pp)
    return load_config(None, [
        f"model.arch={family_arch(arch)}", f"model.vocab_size={VOCAB}", "model.d_model=64",
        f"model.n_layers={n_layers}", "model.n_heads=4", f"model.n_kv_heads={kv_heads(arch)}", "model.ffn_dim=128",
        f"model.max_seq_len={SEQ}",
        f"model.tie_embeddings={tie}", f"train.seq_len={SEQ}", f"parallel.tp={tp}", f"parallel.pp={pp}",
        f"parallel.vpp={vpp}", f"parallel.sp={sp}", f"parallel.schedule={schedule}",
        f"train.micro_batch_size={MICRO}", f"train.global_batch_size={MICRO * dp}", *arch_keys(arch),
        *(GEMMA if arch == "gemma" else ())])


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def pipeline_case(mesh: Mesh, emb_group, schedule: str, m: int, vpp: int = 1, n_layers: int = 4,
                  arch: str = "llama", tie: bool = True, sp: bool = False, split_data: bool = False,
                  steps: int = 5, timing: bool = False, lora: bool = False, clip: float = CLIP,
                  ends: tuple[int, int] | None = None, scatter: bool = False) -> dict:
    """``split_data``: each data-parallel replica gets its own micro-batches (the reference sees them all);
    otherwise every replica runs the same ones (a pure pipeline check on a world larger than pp * tp).
    ``ends``: the end pipeline ranks' layer counts (parallel.pp_first/last_stage_layers; with vpp > 1 each end
    rank's chunks together). ``scatter``: the executors' scatter/gather of messages (parallel.pp_scatter_gather);
    the first step's bytes on the pipeline and tp groups are recorded (``bytes``).
    ``lora``: adapters on every linear, the base frozen (then ``clip`` below the adapters' smaller norm)."""
    cfg = pp_config(mesh.pp, mesh.tp, vpp, sp, n_layers, arch, tie, mesh.world_size, schedule)
    cfg = with_lora(cfg) if lora else cfg
    torch.manual_seed(1234)
    ref = get_family(cfg.model.arch).build(cfg.model).to(mesh.device)
    if lora:
        randomize_adapters(ref)
    full = parallelize_tensor(copy.deepcopy(ref), mesh, sp)  # tensor parallelism on the full model, then cut
    freeze_base(ref, cfg)  # model.lora (no-op otherwise), after the split as the trainer does
    freeze_base(full, cfg)
    base_before = base_params(full) if lora else {}
    stage = build_stage(full, partition_layers(n_layers, mesh.pp, vpp, *(ends or (None, None))), mesh)
    ex = PipelineExecutor(stage, build_schedule(schedule, mesh.pp, vpp, m), mesh, MICRO, SEQ, sp=sp, timing=timing,
                          scatter_gather=scatter, inputs_and_labels=inputs_and_labels)
    sync = PipelineGradientSync(stage, mesh, emb_group if stage.tied_across_stages else None)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.1)
    opt = torch.optim.AdamW(stage.parameters(), lr=3e-3, weight_decay=0.1)
    replicas = mesh.dp if split_data else 1
    gen = torch.Generator().manual_seed(99)
    batches = [token_rows(gen, replicas * m * MICRO, arch).to(mesh.device) for _ in range(steps)]
    mine = slice(mesh.dp_rank * m * MICRO, (mesh.dp_rank + 1) * m * MICRO) if split_data else slice(None)
    out: dict = dict(loss=[], loss_ref=[], norm=[], norm_ref=[], peak=[])
    ref_names = dict(ref.named_parameters())
    for step, batch in enumerate(batches):
        n_micro = batch.shape[0] // MICRO
        total = torch.zeros(())
        for x, y in micro_batches(batch, MICRO):
            loss = ref(x, y) / n_micro
            loss.backward()
            total += loss.detach()
        ref_grads = {n: p.grad.clone() for n, p in ref_names.items() if p.grad is not None}  # frozen: none
        out["norm_ref"].append(torch.nn.utils.clip_grad_norm_(ref.parameters(), clip).item())

        feeds = stage.has_embedding or stage.has_head
        inner = mesh.recorder
        if step == 0:
            mesh.recorder = comm.CommTally({mesh.pp_group: "pp", mesh.tp_group: "tp"}, inner=inner)
        loss = ex.run(batch[mine] if feeds else None)
        if step == 0:
            out["bytes"] = {f"{g} {op}": n for (g, op), n in mesh.recorder.bytes.items()}
            mesh.recorder = inner
        sync.finish()
        if split_data:  # report the global-batch mean, as train.py's _dp_mean does
            loss = comm.all_reduce(loss.clone(), mesh.dp_group) / mesh.dp
        if step == 0:
            grads = gather_full_grads(stage.model, mesh)
            out["grad_err"] = {}
            for name, g in grads.items():
                ref_name = name if name in ref_names else "tok_emb.weight"  # the tied head's copy
                if g is None or ref_name not in ref_grads:  # frozen (LoRA's base): no gradient on either side
                    out["grad_err"][name] = (0.0, 0.0, g is None and ref_name not in ref_grads)
                    continue
                r = ref_grads[ref_name]
                out["grad_err"][name] = (_err(g, r), r.abs().max().item(),
                                         torch.allclose(g, r, rtol=1e-4, atol=1e-5))
            out["names"] = sorted(grads)
            out["ref_names"] = sorted(ref_names)
            out["param_names"] = [n for n, _ in stage.model.named_parameters()]
        out["norm"].append(sync.clip(clip).item())
        out["peak"].append(ex.peak_activations)
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad(set_to_none=True)
        opt.zero_grad(set_to_none=True)
        out["loss_ref"].append(total.item())
        out["loss"].append(loss.item())
    out["clip"] = clip
    if lora:
        out["base_changed"] = base_changed(stage.model, {n: base_before[n] for n, _ in
                                                         stage.model.named_parameters() if n in base_before})
    tied = tied_parameter(stage)  # the embedding, or its last-stage copy (tied head, or MTP's lookup)
    out["tied_weight"] = tied.detach().clone() if tied is not None else None
    if timing:
        out["events"] = [(a.kind, a.microbatch, a.stage, a.start, a.end) for a in ex.events]
    # Evaluation: a forward-only schedule gives the reference's loss on new data.
    ev = PipelineExecutor(stage, forward_only(mesh.pp, vpp, m), mesh, MICRO, SEQ, sp=sp, scatter_gather=scatter,
                          inputs_and_labels=inputs_and_labels)
    eval_batch = token_rows(gen, m * MICRO, arch).to(mesh.device)
    with torch.no_grad():
        ref_eval = sum(ref(x, y) for x, y in micro_batches(eval_batch, MICRO)) / m
    out["eval"] = (ev.run(eval_batch if stage.has_embedding or stage.has_head else None).item(), ref_eval.item())
    return out


CASES_PP4 = [(s, m) for s in ("gpipe", "1f1b", "zb") for m in (4, 8)]
CASES_PP2 = [(s, m) for s in ("gpipe", "1f1b", "zb") for m in (2, 4)]


def suite_pipeline_world4(rank: int, world: int, device: torch.device) -> dict:
    res: dict = {}
    mesh = Mesh.build(pp_config(pp=4), world, rank, device)
    group = build_embedding_groups(mesh)
    for schedule, m in CASES_PP4:
        res[f"pp4-{schedule}-m{m}"] = pipeline_case(mesh, group, schedule, m, timing=(schedule, m) == ("zb", 4))
    for m in (4, 8):  # 8 virtual stages need 8 layers
        res[f"pp4-interleaved-v2-m{m}"] = pipeline_case(mesh, group, "interleaved", m, vpp=2, n_layers=8)
    # Llama 3's uneven interleaving at small size: 14 layers, 3 on each end rank (chunks 1 + 2 and 2 + 1), 4 (2 + 2)
    # on the others
    res["pp4-interleaved-v2-m4-ends3"] = pipeline_case(mesh, group, "interleaved", 4, vpp=2, n_layers=14,
                                                       ends=(3, 3))
    res["pp4-1f1b-m4-gpt2-untied"] = pipeline_case(mesh, group, "1f1b", 4, arch="gpt2", tie=False)

    mesh = Mesh.build(pp_config(pp=2), world, rank, device)  # dp = 2: replicas run the same data
    group = build_embedding_groups(mesh)
    for schedule, m in CASES_PP2:
        res[f"pp2-{schedule}-m{m}"] = pipeline_case(mesh, group, schedule, m)
    for m in (2, 4):
        res[f"pp2-interleaved-v2-m{m}"] = pipeline_case(mesh, group, "interleaved", m, vpp=2)
    res["pp2-dp2-1f1b-m4"] = pipeline_case(mesh, group, "1f1b", 4, split_data=True)
    res["pp2-dp2-zb-m2-gpt2"] = pipeline_case(mesh, group, "zb", 2, arch="gpt2", split_data=True)
    res["pp2-1f1b-m4-qwen3"] = pipeline_case(mesh, group, "1f1b", 4, arch="qwen3")
    res["pp2-1f1b-m4-mla"] = pipeline_case(mesh, group, "1f1b", 4, arch=MLA)  # latent attention across stages
    # multi-token prediction on the last stage, its tokens looked up in the head's tied copy of the embedding
    res["pp2-1f1b-m4-mtp"] = pipeline_case(mesh, group, "1f1b", 4, arch=MTP)
    # untied (DeepSeek-V3's way): the last stage looks them up in its copy of the input embedding
    res["pp2-1f1b-m4-mtp-untied"] = pipeline_case(mesh, group, "1f1b", 4, arch=MTP, tie=False)
    # gemma: its own module (sandwich norms, scaled embedding on the first stage, alternating windows of 5)
    res["pp2-1f1b-m4-gemma"] = pipeline_case(mesh, group, "1f1b", 4, arch="gemma")
    # The encoder: its embedding side (segment embedding, embedding norm) stays on the first stage, the MLM head
    # transform and bias on the last; (inputs, labels) rows as its objective makes them.
    res["pp2-dp2-1f1b-m4-bert"] = pipeline_case(mesh, group, "1f1b", 4, arch="bert", split_data=True)

    mesh = Mesh.build(pp_config(pp=2, tp=2), world, rank, device)
    group = build_embedding_groups(mesh)
    res["pp2-tp2-1f1b-m4"] = pipeline_case(mesh, group, "1f1b", 4)
    # Megatron's scatter/gather of messages (tp without sp): 1/tp of each message between stages
    res["pp2-tp2-1f1b-m4-scatter"] = pipeline_case(mesh, group, "1f1b", 4, scatter=True)
    res["pp2-tp2-zb-m4-scatter"] = pipeline_case(mesh, group, "zb", 4, scatter=True)
    res["pp2-tp2-interleaved-v2-m2-scatter"] = pipeline_case(mesh, group, "interleaved", 2, vpp=2, scatter=True)
    res["pp2-tp2-sp-zb-m4"] = pipeline_case(mesh, group, "zb", 4, sp=True)
    res["pp2-tp2-sp-interleaved-v2-m2-gpt2"] = pipeline_case(mesh, group, "interleaved", 2, vpp=2, sp=True,
                                                             arch="gpt2")
    res["pp2-tp2-sp-1f1b-m4-qwen3"] = pipeline_case(mesh, group, "1f1b", 4, sp=True, arch="qwen3")
    res["pp2-tp2-sp-1f1b-m4-bert"] = pipeline_case(mesh, group, "1f1b", 4, sp=True, arch="bert")
    res["pp2-tp2-sp-1f1b-m4-mla"] = pipeline_case(mesh, group, "1f1b", 4, sp=True, arch=MLA)
    res["pp2-tp2-sp-1f1b-m4-mtp"] = pipeline_case(mesh, group, "1f1b", 4, sp=True, arch=MTP)  # vocab-row lookup
    res["pp2-tp2-sp-1f1b-m4-mtp-untied"] = pipeline_case(mesh, group, "1f1b", 4, sp=True, arch=MTP, tie=False)
    res["pp2-tp2-sp-1f1b-m4-lora"] = pipeline_case(mesh, group, "1f1b", 4, sp=True, lora=True, clip=0.2, steps=3)
    res["pp2-tp2-sp-1f1b-m4-gemma"] = pipeline_case(mesh, group, "1f1b", 4, sp=True, arch="gemma")
    res["coords"] = dict(pp=mesh.pp_rank, tp=mesh.tp_rank)
    return res
