"""The training loop. It should read like a page of prose: set up, then step, log, evaluate, save."""

from __future__ import annotations

import itertools
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from megaloom.checkpoint import AsyncCheckpointer, CheckpointError, load_checkpoint, load_newest, save_checkpoint
from megaloom.config import Config, ConfigError, TrainConfig
from megaloom.data.dataset import build_datasets
from megaloom.data.loader import StepBatches, make_loader
from megaloom.models import Transformer, apply_recompute, count_params
from megaloom.models.fused_ce import FusedHeadLoss
from megaloom.models.transformer import resolved_ffn_dim
from megaloom.observe.flops import device_peak_flops, flops_per_token, matmul_params
from megaloom.observe.memory import peak_memory_gb
from megaloom.observe.memory_fit import auto_micro_batch
from megaloom.observe.memory_plan import GB, MemoryReport
from megaloom.observe.metrics import MetricsSink, console_line
from megaloom.optim import build_optimizer, lr_at, set_lr
from megaloom.parallel import comm
from megaloom.parallel.mesh import Mesh, validate_layout
from megaloom.parallel.pipeline.executor import PipelineExecutor
from megaloom.parallel.pipeline.grads import PipelineGradientSync
from megaloom.parallel.pipeline.partition import validate_pipeline
from megaloom.parallel.pipeline.schedules import build_schedule, forward_only
from megaloom.parallel.pipeline.stage import build_embedding_groups, build_stage
from megaloom.parallel.random import dropout_seed
from megaloom.parallel.tensor import parallelize_tensor
from megaloom.parallel.zero import ShardedOptimizer, build_data_parallel
from megaloom.precision.fp8 import convert_to_float8
from megaloom.resilience.guard import Resilience
from megaloom.runtime import Runtime, init_runtime, resolve_precision, seed_everything
from megaloom.step import TrainStep, autocast_ctx, forward_ctx, micro_batches


@dataclass
class TrainResult:
    run_dir: Path
    final_step: int
    losses: dict[int, float] = field(default_factory=dict)  # step -> logged (interval-mean) loss
    eval_loss: float | None = None


def resolve_model_shape(cfg: Config, tokenizer_vocab: int, pad_multiple: int = 64) -> None:
    """Fill in the model sizes left at 0 ("auto") so that config.yaml records the real shape."""
    m = cfg.model
    if m.vocab_size == 0:
        m.vocab_size = pad_multiple * math.ceil(tokenizer_vocab / pad_multiple)
    elif tokenizer_vocab > m.vocab_size:
        raise ConfigError(f"the tokenizer has {tokenizer_vocab} tokens but model.vocab_size={m.vocab_size}; set "
                          f"model.vocab_size>={tokenizer_vocab} (or 0 to follow the tokenizer).")
    m.n_kv_heads = m.n_kv_heads or m.n_heads
    m.ffn_dim = resolved_ffn_dim(m)


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: list[torch.Tensor], micro: int, precision: str,
             device: torch.device) -> float:
    model.eval()
    total, n = torch.zeros((), device=device), 0
    for batch in batches:
        for x, y in micro_batches(batch.to(device, non_blocking=True), micro):
            with autocast_ctx(precision, device):
                total += model(x, y).float()
            n += 1
    model.train()
    return (total / max(n, 1)).item()


@torch.no_grad()
def evaluate_pipeline(pipe, batches: list[torch.Tensor | None]) -> float:
    losses = [pipe.run(b) for b in batches]  # forward-only schedule; the mean loss arrives on every stage
    return float(torch.stack(losses).mean().item())


def _draw_measured_timeline(pipe, mesh: Mesh, run_dir: Path, step: int, is_main: bool) -> None:
    """Gather every pipeline rank's timed actions of this step and draw them with the planning renderer."""
    from megaloom.observe.timeline import merge_timelines, render_png, write_chrome_trace

    per_rank = comm.all_gather_objects(pipe.timeline(), mesh.pp_group, recorder=mesh.recorder)
    if not is_main:
        return
    tl = merge_timelines(per_rank)
    s = pipe.schedule
    theory = (s.pp - 1) / (s.vpp * s.microbatches)
    png = render_png(tl, run_dir / f"timeline_step{step}.png",
                     title=f"measured step {step}: {s.name} pp={s.pp} vpp={s.vpp} m={s.microbatches} | bubble "
                           f"{100 * tl.bubble_fraction:.1f}% (idle/compute {tl.bubble_ratio:.3f}, theory {theory:.3f})")
    write_chrome_trace(tl, run_dir / f"timeline_step{step}.json")
    print(f"measured pipeline timeline of step {step}: bubble {100 * tl.bubble_fraction:.1f}% of rank time, idle/"
          f"compute {tl.bubble_ratio:.3f} vs theory (p-1)/(v*m) = {theory:.3f}; wrote {png}", flush=True)


def apply_train_options(model: torch.nn.Module, t: TrainConfig, loss_chunk: int | None = None):
    """What train.* changes in the built (tensor-parallel) model before pipeline stages and compile: the blocks'
    linears in float8 (precision=fp8; tp collectives stay bf16), activation recomputation, and the fused
    head + loss (validate() refuses it with tp > 1). Shared with bench/bench_train.py, so that what is measured is
    what trains. ``loss_chunk``: tokens per fused-loss chunk (None: the default). Returns the fp8 summary or None."""
    summary = None
    if t.precision == "fp8":
        summary = convert_to_float8(model, t.fp8_recipe, t.fp8_keep_first_last, t.fp8_fast_accum,
                                    t.fp8_keep_attention)
    apply_recompute(model, t.recompute, t.recompute_layers or None)
    if t.fused_loss:  # head + cross-entropy in chunks, never the full logits
        model.loss = FusedHeadLoss(loss_chunk)
    return summary


def _choose_micro_batch(cfg: Config, rt: Runtime, device: torch.device) -> None:
    """train.micro_batch_size=0: the largest micro-batch the memory plan fits on this GPU (`auto_micro_batch`);
    every rank takes the smallest of the ranks' choices, so that all run the same schedule."""
    budget = torch.cuda.get_device_properties(device).total_memory / GB if device.type == "cuda" else None
    mb, peak = auto_micro_batch(cfg, rt.world_size, budget)
    world = torch.distributed.group.WORLD if rt.world_size > 1 else None
    mb = int(comm.all_reduce(torch.tensor([mb], device=device), world, op="min").item())
    cfg.train.micro_batch_size = mb
    if rt.is_main:
        why = (f"planned peak {peak:.1f} GB of {budget:.1f} GB" if peak is not None
               else "the whole per-rank batch: no device memory limit to plan against")
        print(f"megaloom: train.micro_batch_size=0 (auto) -> {mb} ({why})", flush=True)


def _blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    return list(model.layers.values())


def train(cfg: Config, stop_after: int | None = None) -> TrainResult:
    """Train per `cfg`. `stop_after` ends the process's work after that step as a preemption would (tests)."""
    _refuse_unbuilt(cfg)
    sizes = validate_layout(cfg, int(os.environ.get("WORLD_SIZE", "1")))  # before any process group or data
    partition = validate_pipeline(cfg, sizes["dp"], cfg.parallel.pp_first_stage_layers or None,
                                  cfg.parallel.pp_last_stage_layers or None) if cfg.parallel.pp > 1 else None
    if cfg.parallel.zero and cfg.parallel.pp > 1:
        raise ConfigError("parallel.zero>=1 together with parallel.pp>1 is not available yet (the tied-embedding "
                          "sum must precede the reduce-scatter); use parallel.zero=0 with pipelines.")
    if cfg.parallel.zero and sizes["dp"] == 1:
        raise ConfigError(f"parallel.zero={cfg.parallel.zero} shards over data-parallel ranks, but dp=1 (world "
                          f"{sizes['world']} = tp*pp*cp); set parallel.zero=0 or run more processes.")
    rt: Runtime = init_runtime(cfg)
    t, device = cfg.train, rt.device
    mesh = Mesh.build(cfg, rt.world_size, rt.rank, device) if rt.world_size > 1 else Mesh.single(device)
    if rt.is_main and rt.world_size > 1:
        print(f"megaloom: mesh of {rt.world_size} ranks (tp={mesh.tp} pp={mesh.pp} dp={mesh.dp} cp={mesh.cp} "
              f"ep={mesh.ep}) built in {mesh.init_seconds:.3f}s", flush=True)
    precision = resolve_precision(cfg, device)
    cfg.train.precision = precision
    run_dir = Path(cfg.run.dir)

    # Data first: a missing or corrupt corpus fails before the model is built.
    local_batch = t.global_batch_size // mesh.dp  # this data-parallel rank's share of every global batch
    train_ds, valid_ds, tokenizer = build_datasets(cfg.data, t.seq_len, t.seed, t.steps * t.global_batch_size,
                                                   t.eval_batches * t.global_batch_size)
    if not cfg.data.tokenizer:
        cfg.data.tokenizer = str(Path(tokenizer.path).resolve())
    resolve_model_shape(cfg, tokenizer.vocab_size, pad_multiple=math.lcm(64, cfg.parallel.tp))
    if t.micro_batch_size == 0:
        _choose_micro_batch(cfg, rt, device)
    n_micro = local_batch // t.micro_batch_size

    if rt.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(cfg.to_yaml())

    seed_everything(t.seed)
    model = Transformer(cfg.model).to(device)  # full model, same seed on every rank ...
    n_params = count_params(model)
    fpt = flops_per_token(cfg.model, matmul_params(model), t.seq_len)
    model = parallelize_tensor(model, mesh, cfg.parallel.sp)  # ... then each rank keeps its shards
    fp8_summary = apply_train_options(model, t)  # before stages and compile
    if fp8_summary is not None and rt.is_main:
        print(f"megaloom: {fp8_summary}", flush=True)
    torch.manual_seed(dropout_seed(t.seed, mesh))  # dropout: equal across tp peers, distinct across data
    pipe = eval_pipe = None
    if mesh.pp > 1:
        # Pipeline: each rank keeps its stages' layers (names unchanged); a schedule executor runs micro-batches.
        stage = build_stage(model, partition, mesh)  # model is pruned to this rank's stages in place
        emb_group = build_embedding_groups(mesh) if cfg.model.tie_embeddings else None  # collective
        m_train, m_eval = n_micro, n_micro
        auto = lambda: forward_ctx(precision, device, t.offload_activations)  # noqa: E731
        pipe = PipelineExecutor(stage, build_schedule(cfg.parallel.schedule, mesh.pp, cfg.parallel.vpp, m_train),
                                mesh, t.micro_batch_size, t.seq_len, sp=cfg.parallel.sp, autocast=auto)
        eval_pipe = PipelineExecutor(stage, forward_only(mesh.pp, cfg.parallel.vpp, m_eval), mesh,
                                     t.micro_batch_size, t.seq_len, sp=cfg.parallel.sp, autocast=auto)
        grads = PipelineGradientSync(stage, mesh, emb_group)
    # Data parallelism: gradient buckets reduced during the last backward (zero 0), reduce-scattered into a
    # sharded optimizer (zero 1/2), or FSDP2-sharded parameters (zero 3). Built before compile: FSDP2 wraps blocks.
    elif rt.world_size > 1:
        grads = build_data_parallel(model, mesh, cfg.parallel.zero, cfg.parallel.bucket_mb)
    else:
        grads = None
    if t.compile:
        for layer in _blocks(model):
            layer.compile()  # in place: parameter names (and so checkpoints) stay the same
    if cfg.parallel.zero >= 1:
        optimizer = ShardedOptimizer(grads, t.optimizer, lr=t.lr, betas=(t.beta1, t.beta2),
                                     eps=1e-8 if t.optimizer == "adamw" else 1e-6, weight_decay=t.weight_decay,
                                     overlap_param_gather=not t.compile)
    else:
        optimizer = build_optimizer(model, t, device, mesh)
    train_step = TrainStep(model, optimizer, precision, device, t.micro_batch_size, t.grad_clip, grads,
                           nan_guard=cfg.resilience.nan_guard, pipeline=pipe, attention=t.attention,
                           offload=t.offload_activations)

    ckpt_root = run_dir / "checkpoints"
    start_step, resumed_state = _maybe_resume(cfg, model, optimizer, ckpt_root, rt, mesh)
    if train_step.scaler is not None and "loss_scaler" in resumed_state:
        train_step.scaler.load_state_dict(resumed_state["loss_scaler"])

    peak = device_peak_flops(device)
    if rt.is_main:
        print(f"megaloom: {cfg.model.preset} ({cfg.model.arch}) {n_params / 1e6:.2f}M params on {device}, "
              f"{precision}, {t.steps} steps x {t.global_batch_size} x {t.seq_len} tokens "
              f"({n_micro} micro-batches of {t.micro_batch_size}); run dir {run_dir}", flush=True)
    # Predicted bytes per rank (weights, gradients, optimizer, activations), printed and written to memory.json;
    # compared with the measured peak after the first steps. Rank 0 plans its own stage; no forward is run.
    memory_report = MemoryReport.start(cfg, model, world_size=rt.world_size, device=device, pp_rank=mesh.pp_rank,
                                       n_micro=n_micro, run_dir=run_dir, enabled=rt.is_main)

    # Only the ranks that need tokens read them (MegaScale): the first pipeline stage (inputs) and the last
    # (labels); middle stages get None. Tensor-parallel peers read the same rows.
    reads_data = mesh.pp == 1 or mesh.is_first_stage or mesh.is_last_stage
    eval_batches = [torch.stack([torch.as_tensor(valid_ds[i * t.global_batch_size + mesh.dp_rank * local_batch + j])
                                 for j in range(local_batch)]) if reads_data else None for i in range(t.eval_batches)]
    sink = MetricsSink(run_dir, cfg.run.tensorboard, enabled=rt.is_main)
    result = TrainResult(run_dir=run_dir, final_step=start_step)
    guard = Resilience(cfg, run_dir, rt.rank, rt.world_size, mesh)
    saver = None
    if cfg.checkpoint.async_save and mesh.pp == 1:
        report = (lambda r: print(f"checkpoint {r.path.name} written in {r.write_s:.2f}s (background)", flush=True))
        saver = AsyncCheckpointer(on_written=report if rt.is_main else None)
    pending_stall: float | None = None
    # After a rollback the data stream skips the window that produced non-finite steps: step s then reads
    # the batch of s + data_offset. Saved with every checkpoint, so resume stays exact.
    data_offset = int(resumed_state.get("data_offset", 0))

    loss_sum = torch.zeros((), device=device)
    steps_in_interval, interval_compute_s, skipped = 0, 0.0, 0
    train_start = time.perf_counter()
    step = start_step
    while step < t.steps:
        if data_offset and len(train_ds) < (t.steps + data_offset) * t.global_batch_size:
            train_ds, _, _ = build_datasets(cfg.data, t.seq_len, t.seed, (t.steps + data_offset) * t.global_batch_size,
                                            t.eval_batches * t.global_batch_size)
        batches = StepBatches(train_ds, t.global_batch_size, rank_offset=mesh.dp_rank * local_batch,
                              rank_size=local_batch, start_step=step + data_offset, n_steps=t.steps - step)
        loader = (make_loader(batches, cfg.data.num_workers, cfg.data.prefetch, pin_memory=device.type == "cuda")
                  if reads_data else itertools.repeat(None, t.steps - step))
        rollback = False
        for batch in loader:
            step_t0 = time.perf_counter()
            guard.before_step(step + 1, model, data_step=step + 1 + data_offset)
            batch = batch.to(device, non_blocking=True) if batch is not None else None
            lr = lr_at(step, t)
            set_lr(optimizer, lr)
            timed = pipe is not None and step + 1 == cfg.parallel.timeline_step
            if timed:
                pipe.timing = True
            out = train_step(batch)
            if timed:
                pipe.timing = False
                _draw_measured_timeline(pipe, mesh, run_dir, step + 1, rt.is_main)
            loss_sum += out.loss
            grad_norm = out.grad_norm
            skipped += int(out.skipped)
            step += 1
            steps_in_interval += 1
            if device.type == "cuda" and step % t.log_every == 0:
                torch.cuda.synchronize(device)  # so the interval's timing covers the GPU work it queued
            wall = time.perf_counter() - step_t0
            interval_compute_s += wall
            rollback = guard.after_step(step, out.skipped, wall)

            stragglers = None
            if guard.stragglers_due(step):
                slow, times = guard.straggler.check()
                stragglers = {"stragglers": slow, "compute_s_per_rank": times}
                if slow and rt.is_main:
                    print(f"WARNING: straggler rank(s) {slow} at step {step}: compute s/step per rank "
                          f"{[round(x, 4) for x in times]}", flush=True)
            do_eval = (t.eval_every and step % t.eval_every == 0) or step == t.steps
            if step % t.log_every == 0 or do_eval or stragglers is not None:
                tokens = steps_in_interval * t.global_batch_size * t.seq_len
                tps = tokens / max(interval_compute_s, 1e-9)
                record = {"step": step, "loss": _dp_mean(loss_sum / steps_in_interval, mesh), "lr": lr,
                          "grad_norm": float(grad_norm), "tokens_per_s": tps,
                          "mfu": (fpt * tps / (peak * rt.world_size)) if peak else None,
                          "mem_gb": peak_memory_gb(device), "tokens": step * t.global_batch_size * t.seq_len,
                          "skipped_steps": skipped, "elapsed_s": time.perf_counter() - train_start}
                if stragglers is not None:
                    record.update(stragglers)
                moe = train_step.moe
                if moe:  # per MoE layer: the busiest expert's load over the mean (1 = balanced), dropped share
                    record["moe_load_max_over_mean"] = [round(float(m.last_load.max() / m.last_load.float().mean()
                                                                    .clamp(min=1e-9)), 4) for m in moe]
                    record["moe_tokens_per_expert"] = [m.last_load.tolist() for m in moe]
                    record["moe_aux_loss"] = float(sum(float(m.aux_loss.detach()) for m in moe))  # last micro-batch
                    record["moe_dropped_fraction"] = float(sum(float(m.last_dropped_fraction) for m in moe) / len(moe))
                if pending_stall is not None:
                    record["ckpt_stall_s"], pending_stall = pending_stall, None
                if do_eval:
                    with guard.paused():
                        ev = (evaluate(model, eval_batches, t.micro_batch_size, precision, device) if eval_pipe is None
                              else evaluate_pipeline(eval_pipe, eval_batches))
                    record["eval_loss"] = _dp_mean(torch.tensor(ev, device=device), mesh)
                    record["eval_ppl"] = math.exp(min(record["eval_loss"], 50.0))
                    result.eval_loss = record["eval_loss"]
                sink.log(record)
                result.losses[step] = record["loss"]
                if rt.is_main:
                    eta = (t.steps - step) * interval_compute_s / steps_in_interval
                    line = console_line(record, t.steps, eta)
                    if do_eval:
                        line += f" | eval {record['eval_loss']:.4f} (ppl {record['eval_ppl']:.1f})"
                    print(line, flush=True)
                    if memory_report is not None:
                        memory_report.after_step(step, t.steps)
                loss_sum.zero_()
                steps_in_interval, interval_compute_s = 0, 0.0

            if rollback:
                if saver is not None:
                    saver.wait(rt.barrier)
                back_to = _rollback(cfg, model, optimizer, ckpt_root, rt, mesh)
                data_offset += step - back_to  # the bad window's data is never seen again
                if rt.is_main:
                    print(f"ROLLBACK: {cfg.resilience.max_bad_steps} non-finite steps in a row up to step {step}; "
                          f"restored step {back_to} and skipping the data of steps {back_to + 1}..{step} "
                          f"(data offset now {data_offset} steps)", flush=True)
                step, guard.bad_in_a_row = back_to, 0
                loss_sum.zero_()
                steps_in_interval, interval_compute_s = 0, 0.0
                break
            due = cfg.checkpoint.every and step % cfg.checkpoint.every == 0
            if due and guard.bad_in_a_row and step != t.steps:
                due = False  # never checkpoint inside a run of non-finite steps: a rollback must go before it
            if due or (step == t.steps and cfg.checkpoint.final):
                with guard.paused():
                    pending_stall = _save(cfg, model, optimizer, ckpt_root, step, rt, mesh, train_step, data_offset,
                                          saver)
            if stop_after is not None and step >= stop_after:
                break
        if not rollback:
            break
    if saver is not None:
        saver.wait(rt.barrier)  # the last checkpoint is on disk before train() returns
    guard.close()
    result.final_step = step
    sink.close()
    return result


def _rollback(cfg: Config, model, optimizer, ckpt_root: Path, rt: Runtime, mesh: Mesh) -> int:
    """Restore the newest checkpoint that verifies (model, optimizer, RNG); returns its step."""
    found = load_newest(ckpt_root, model, optimizer, rank=rt.rank, model_cfg=cfg.model.__dict__, mesh=mesh,
                        warn=_main_print(rt))
    if found is None:
        raise RuntimeError("non-finite steps in a row and no checkpoint to roll back to; set checkpoint.every "
                           "lower, lower train.lr, or check the data.")
    optimizer.zero_grad(set_to_none=True)
    return int(found[1]["step"])


def _main_print(rt: Runtime):
    return (lambda msg: print(msg, flush=True)) if rt.is_main else (lambda msg: None)


def _dp_mean(x: torch.Tensor, mesh: Mesh) -> float:
    """Mean of a per-rank scalar over the data-parallel replicas (tp/pp peers already agree)."""
    if mesh.dp * mesh.cp > 1:
        x = x.detach().clone().float()
        comm.all_reduce(x, mesh.dp_cp_group, recorder=mesh.recorder)
        x /= mesh.dp * mesh.cp
    return float(x.item())


def _refuse_unbuilt(cfg: Config) -> None:
    """Say plainly which parallel features this build does not have yet, instead of ignoring the setting."""
    p = cfg.parallel
    if p.ep > 1 and not cfg.model.moe_every:
        raise ConfigError(f"parallel.ep={p.ep} splits MoE experts, but this model has none (model.moe_every=0); "
                          "set parallel.ep=1 or choose an MoE preset (e.g. model.preset=mixtral-tiny).")
    if p.cp != 1:
        raise ConfigError(f"parallel.cp={p.cp} is not available in this build yet (tensor/sequence, pipeline, "
                          "expert and data parallelism with ZeRO are); set parallel.cp=1.")


def _run_state(cfg: Config, step: int) -> dict:
    return {"consumed_samples": step * cfg.train.global_batch_size, "model": cfg.model.__dict__.copy(),
            "seq_len": cfg.train.seq_len, "seed": cfg.train.seed}


def _save(cfg: Config, model, optimizer, ckpt_root: Path, step: int, rt: Runtime, mesh: Mesh,
          train_step: TrainStep, data_offset: int, saver: AsyncCheckpointer | None) -> float:
    """Checkpoint `step`; returns the seconds the training loop was blocked."""
    t0 = time.perf_counter()
    state = _run_state(cfg, step)
    state["data_offset"] = data_offset
    if train_step.scaler is not None:
        state["loss_scaler"] = train_step.scaler.state_dict()
    if saver is not None:
        rec = saver.save(ckpt_root, step, model, optimizer, state, cfg.checkpoint.keep, rank=rt.rank,
                         barrier=rt.barrier, mesh=mesh)
        if rt.is_main:
            print(f"checkpoint step {step}: training paused {rec.stall_s:.3f}s (copy to host; "
                  f"{rec.wait_s:.3f}s of it waiting for the previous write), writing in the background", flush=True)
        return rec.stall_s
    path = save_checkpoint(ckpt_root, step, model, optimizer, state, cfg.checkpoint.keep,
                           rank=rt.rank, barrier=rt.barrier, mesh=mesh)
    stall = time.perf_counter() - t0
    if rt.is_main:
        print(f"saved checkpoint {path} in {stall:.2f}s", flush=True)
    return stall


def _maybe_resume(cfg: Config, model, optimizer, ckpt_root: Path, rt: Runtime, mesh: Mesh) -> tuple[int, dict]:
    """Load the requested checkpoint; with resume=auto, the newest one that verifies. Returns (step, state)."""
    choice = cfg.checkpoint.resume
    if choice == "none":
        return 0, {}
    if choice == "auto":
        found = load_newest(ckpt_root, model, optimizer, rank=rt.rank, model_cfg=cfg.model.__dict__, mesh=mesh,
                            warn=_main_print(rt))
        if found is None:
            return 0, {}
        path, state = found
    else:
        path = Path(choice)
        if not path.is_dir():
            raise CheckpointError(f"checkpoint.resume: directory '{choice}' not found.")
        state = load_checkpoint(path, model, optimizer, rank=rt.rank, model_cfg=cfg.model.__dict__, mesh=mesh)
    _check_data_compatible(state, cfg)
    if rt.is_main:
        print(f"resumed from {path} at step {state['step']}", flush=True)
    return int(state["step"]), state


def _check_data_compatible(state: dict, cfg: Config) -> None:
    if state.get("seq_len") not in (None, cfg.train.seq_len):
        raise CheckpointError(f"checkpoint was trained with train.seq_len={state['seq_len']} but the config says "
                              f"{cfg.train.seq_len}; exact data resume needs the same value.")


def load_run_config(run_dir: Path) -> Config:
    import yaml

    from megaloom.config import config_from_dict

    path = run_dir / "config.yaml"
    if not path.is_file():
        raise ConfigError(f"--run {run_dir}: no config.yaml there (is it a megaloom run directory?).")
    return config_from_dict(yaml.safe_load(path.read_text()))


