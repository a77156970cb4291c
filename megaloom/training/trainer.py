"""The Trainer: build once (preflight, runtime, data, resolved config, model, optimizer, resume), then step, log,
evaluate and checkpoint until the last step, rolling back past runs of non-finite steps.

    trainer = Trainer(cfg).build()
    result = trainer.fit()

`self.cfg` is the resolved config: written to run.dir/config.yaml by `build`, never changed afterwards; the config as
given (`self.requested`) goes to run.dir/requested.yaml beside it.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import sys
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from megaloom import accelerator
from megaloom.checkpoint.group import CheckpointGroup
from megaloom.checkpoint.store import remove_partial_saves
from megaloom.config import REQUESTED_CONFIG, RUN_CONFIG, Config, ConfigError
from megaloom.data.chat.identity import chat_identity
from megaloom.data.dataset import build_datasets, source_prefixes
from megaloom.data.identity import data_identity
from megaloom.data.image_text.batch import ImageTextBatch
from megaloom.data.loader import StepBatches, batches_of, make_loader
from megaloom.data.objective import ObjectiveDataset, inputs_and_labels
from megaloom.fa4 import check_fa4
from megaloom.models import count_params, registry
from megaloom.models.attention_kernel import attention_backend
from megaloom.models.documents import Documents
from megaloom.models.freeze import freeze_for_training
from megaloom.models.lora import describe as lora_summary
from megaloom.models.registry import get_family
from megaloom.observe.flops import (
    device_peak_flops,
    flops_per_token,
    frozen_matmul_params,
    image_flops,
    matmul_params,
)
from megaloom.observe.log import get_logger
from megaloom.observe.memory import peak_memory_gb
from megaloom.observe.metrics import MetricsSink, console_line, format_eta
from megaloom.optim.build import build_optimizer, lr_at, set_lr
from megaloom.optim.muon import ShardedMuon
from megaloom.optim.offload import build_offloaded
from megaloom.optim.onebit import KINDS as ONEBIT_KINDS
from megaloom.optim.onebit import PAD_MULTIPLE as ONEBIT_PAD
from megaloom.optim.onebit import build_onebit
from megaloom.optim.qk_clip import install_qk_clip
from megaloom.optim.zero import ShardedOptimizer, build_data_parallel
from megaloom.parallel.context import SequenceShard, parallelize_context
from megaloom.parallel.data_parallel import param_gather_dtype
from megaloom.parallel.materialize import materialize
from megaloom.parallel.mesh import Mesh
from megaloom.parallel.pipeline.executor import PipelineExecutor
from megaloom.parallel.pipeline.schedules import build_schedule, forward_only
from megaloom.parallel.pipeline.stage import build_embedding_groups, build_stage, tied_parameter
from megaloom.parallel.random import dropout_seed
from megaloom.parallel.tensor import parallelize_tensor
from megaloom.planning.levers import describe_levers, resolve_levers
from megaloom.planning.memory_plan import MemoryReport
from megaloom.preflight import Checked, preflight, preflight_vocab, world_size_from_env
from megaloom.resilience import suspects
from megaloom.resilience.guard import Resilience
from megaloom.resilience.peers import PeerLost, describe, peer_loss
from megaloom.resilience.rollbacks import RollbackBudget
from megaloom.resilience.run_lock import RunLock, lock_run_dir
from megaloom.resilience.signals import StopRequests, signal_name
from megaloom.runtime import (
    Runtime,
    collective_timeout,
    init_runtime,
    resolve_precision,
    seed_everything,
    shorten_timeouts,
)
from megaloom.step import TrainStep, forward_ctx
from megaloom.training.checkpoints import RunCheckpoints
from megaloom.training.compile_saves import set_lean_saves
from megaloom.training.data import default_builder, load_rank_datasets
from megaloom.training.evaluate import eval_batches, evaluate, evaluate_pipeline
from megaloom.training.options import apply_train_options, mtp_loss_weight_at
from megaloom.training.records import Interval, dp_mean, moe_fields
from megaloom.training.resolve import (
    choose_micro_batch,
    resolve_config,
    resolve_recompute_casts,
    with_micro_batch,
)
from megaloom.training.timeline import draw_measured_timeline

log = get_logger(__name__)


@dataclass
class TrainResult:
    run_dir: Path
    final_step: int
    losses: dict[int, float] = field(default_factory=dict)  # step -> logged (interval-mean) loss
    eval_loss: float | None = None
    stopped_by: str | None = None  # "SIGTERM", "SIGUSR1" or "SIGINT" when a signal stopped the run early


class Trainer:
    def __init__(self, cfg: Config, *, runtime: Runtime | None = None, datasets=None) -> None:
        """``runtime``: a process group the caller has started (a dry run's fake backend, training/dryrun.py);
        by default `init_runtime` starts one from torchrun's environment. ``datasets``: called as
        `build_datasets` is (the default), for (train, valid, tokenizer); a dry run passes synthetic tokens."""
        self.requested = cfg  # as given: never changed
        self.cfg: Config | None = None  # the resolved config, set by build()
        self._runtime, self._datasets = runtime, datasets
        # Seconds spent building: mesh (process groups), model (meta build, parallel plan, pipeline cut),
        # materialize (this rank's slices allocated and initialised), wrappers (pipeline executors, gradient
        # reduction), optimizer.
        self.build_seconds: dict[str, float] = {}

    # ------------------------------------------------------------------------------------------------ build

    def build(self) -> Trainer:
        """Everything before the first step, each failure as early as it can be known."""
        world = self._runtime.world_size if self._runtime is not None else world_size_from_env()
        checked = preflight(self.requested, world)  # before any process group or data
        self._start_runtime()
        self._take_run_dir()
        try:
            self._load_data()  # data first: a missing or corrupt corpus fails before the model is built
            preflight_vocab(self.requested.model, self.tokenizer.vocab_size)  # tokenizer known: before the model
            self.cfg = self._resolve()
            self._write_run_config()
            t0 = time.perf_counter()
            self._build_model_and_optimizer(checked)
            log.debug(f"model, parallel wrappers and optimizer built in {time.perf_counter() - t0:.2f}s")
            self._resume()
            self._start_observers()
        except BaseException:
            self._restore_run_config()
            self.run_lock.release(discard=True)  # a failed start leaves no .lock it created
            raise
        return self

    def _take_run_dir(self) -> None:
        """Rank 0 locks run.dir for the run's life (a second run is refused, naming this one), then removes the
        partial saves a crash or a full disk left behind: with the lock held, no other run can be writing them."""
        self.run_lock = lock_run_dir(self.run_dir) if self.rt.is_main else RunLock(None)
        if self.rt.is_main:
            remove_partial_saves(self.run_dir / "checkpoints")

    def _start_runtime(self) -> None:
        cfg = self.requested
        self.rt = rt = self._runtime or init_runtime(cfg)
        self.device = rt.device
        self.mesh = mesh = (Mesh.build(cfg, rt.world_size, rt.rank, self.device) if rt.world_size > 1
                            else Mesh.single(self.device))
        self.build_seconds["mesh"] = mesh.init_seconds
        # The host-side gloo group of start-up and checkpoints (collective: every rank makes it here): the data-cache
        # build's barriers and every DCP save and load run on it, with checkpoint.timeout_s, never on the default
        # (NCCL) group with the training timeout (checkpoint/group.py).
        self.host = CheckpointGroup(cfg.checkpoint.timeout_s)
        if rt.world_size > 1:
            log.info(f"megaloom: mesh of {rt.world_size} ranks (tp={mesh.tp} pp={mesh.pp} dp={mesh.dp} cp={mesh.cp} "
                     f"ep={mesh.ep}) built in {mesh.init_seconds:.3f}s")
        log.debug(f"mesh: {mesh.describe()} on {self.device}")
        self.precision = resolve_precision(cfg, self.device)
        self.run_dir = Path(cfg.run.dir)

    def _load_data(self) -> None:
        t = self.requested.train
        self.local_batch = t.global_batch_size // self.mesh.dp  # this data-parallel rank's share of a global batch
        # Only the ranks that need tokens read them (MegaScale): the first pipeline stage (inputs) and the last
        # (labels); middle stages load the tokenizer and nothing else. Tensor-parallel peers read the same rows.
        mesh = self.mesh
        # Document boundaries (data.document_mask / reset_positions) are found from the tokens on every stage.
        d = self.requested.data
        self.reads_data = (mesh.pp == 1 or mesh.is_first_stage or mesh.is_last_stage
                           or d.document_mask or d.reset_positions)
        self.train_ds, self.valid_ds, self.tokenizer = load_rank_datasets(
            self._datasets, self.requested.data, t.seq_len, t.seed, t.steps * t.global_batch_size,
            t.eval_batches * t.global_batch_size, self.rt, self.reads_data,
            default=default_builder(self.requested, build_datasets), host=self.host)
        # A family whose objective is not next-token prediction (BERT's masked LM) turns each row into
        # (inputs, labels) as the loader reads it, from (seed, sample index) alone (data/objective.py).
        # What the token files are (sizes, counts, cheap hashes), saved with each checkpoint and compared on resume;
        # every rank reads it (a few MiB at most), so every rank takes the same decision. Not for image-text sets
        # or a caller's datasets (a dry run's synthetic tokens).
        self.data_identity = (None if self._datasets is not None or registry.reads_images(self.requested.model)
                              else chat_identity(self.requested.data, self.tokenizer)
                              if self.requested.data.format == "chat"
                              else data_identity(source_prefixes(self.requested.data)))
        objective = registry.get_family(self.requested.model.arch).objective  # a lookup: no model is built
        self.objective = objective.build(self.requested, self.tokenizer) if objective is not None else None
        if self.objective is not None:
            self.train_ds = ObjectiveDataset(self.train_ds, self.objective, "train")
            self.valid_ds = ObjectiveDataset(self.valid_ds, self.objective, "valid")
        log.debug(f"data: {len(self.train_ds)} training and {len(self.valid_ds)} validation samples; tokenizer "
                  f"{self.tokenizer.path} ({self.tokenizer.vocab_size} tokens)")

    def _resolve(self) -> Config:
        """The resolved config (a new object): sizes, precision, tokenizer path, and the micro-batch."""
        m, ob = self.requested.model, self.objective
        if ob is not None and m.vocab_size and self.tokenizer.vocab_size <= m.vocab_size < ob.vocab_size:
            raise ConfigError(f"model.vocab_size={m.vocab_size}: the tokenizer's {self.tokenizer.vocab_size} tokens "
                              f"and the {ob.vocab_size - self.tokenizer.vocab_size} special ids the model.arch="
                              f"{m.arch} objective adds (those the tokenizer lacks) need {ob.vocab_size}; set "
                              f"model.vocab_size>={ob.vocab_size} (or 0 to follow the tokenizer).")
        cfg = resolve_config(self.requested, precision=self.precision, tokenizer_path=self.tokenizer.path,
                             tokenizer_vocab=(self.objective or self.tokenizer).vocab_size,
                             image_token_id=getattr(self.tokenizer, "image_id", None))
        capability = accelerator.cuda_capability(self.device)
        cfg, levers = resolve_levers(cfg, self.device.type, capability)  # the speed levers left at "auto"
        if levers and self.rt.is_main:  # on CPU every lever stays off: said at debug level only, unless the
            # model chose one (soft-capped attention runs the math core everywhere: a kernel worth naming)
            chosen = any(c.key == "train.attention" and c.value == "math" for c in levers)
            (log.info if accelerator.is_accelerator(self.device) or chosen else log.debug)(
                f"megaloom: {describe_levers(levers)}")
        if cfg.train.attention == "fa4" and accelerator.is_accelerator(self.device):
            check_fa4(self.device)  # before the build: refused where it cannot run (not CUDA), naming the fix
        elif cfg.train.attention == "fa4":  # a GPU job's config tried on CPU (a dry run): SDPA, as cudnn would be
            (log.info if self.rt.is_main else log.debug)("megaloom: train.attention=fa4 runs on GPUs; on CPU the "
                                                         "attention is PyTorch's SDPA (train.attention=torch)")
            cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, attention="torch"))
        cfg = resolve_recompute_casts(cfg, self.rt, self.device)  # needs compile resolved; before the micro-batch
        if cfg.train.micro_batch_size == 0:
            cfg = with_micro_batch(cfg, choose_micro_batch(cfg, self.rt, self.device))  # a collective
        self.n_micro = self.local_batch // cfg.train.micro_batch_size
        return cfg

    def _write_run_config(self) -> None:
        """run.dir/config.yaml: the resolved config (every "auto" filled in: what this run is, read back by resume,
        generate and convert); run.dir/requested.yaml: the config as given, each default as the user wrote it, to
        pass to another machine or cluster, where the "auto" choices (precision, levers, micro-batch) are made again
        for it. Both load with `megaloom train --config`."""
        if self.rt.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self._previous_configs = {}
            for name, cfg in ((RUN_CONFIG, self.cfg), (REQUESTED_CONFIG, self.requested)):
                path = self.run_dir / name
                self._previous_configs[name] = path.read_text() if path.is_file() else None
                path.write_text(cfg.to_yaml())

    def _restore_run_config(self) -> None:
        """A start that failed after writing config.yaml (a checkpoint of another shape, say) puts back the files
        the run directory had: the next `megaloom train --config RUN/config.yaml` reads the run's, not the
        refused settings."""
        if not self.rt.is_main:
            return
        for name, previous in getattr(self, "_previous_configs", {}).items():
            try:
                if previous is not None:
                    (self.run_dir / name).write_text(previous)
            except OSError:
                pass

    def _build_model_and_optimizer(self, checked: Checked) -> None:
        """This rank's model (built shard by shard), its pipeline executors or data-parallel gradients, compile,
        the optimizer and the step."""
        cfg, t, rt, mesh, device = self.cfg, self.cfg.train, self.rt, self.mesh, self.device
        model, stage = self._build_model(checked)
        t0 = time.perf_counter()
        pipe = eval_pipe = None
        fsdp = stage is None and rt.world_size > 1 and cfg.parallel.zero == 3
        gather_dtype = param_gather_dtype(cfg.parallel.param_gather, self.precision)
        # 1-bit optimizers run on the buckets (one process too: frozen variance, nothing to compress); their
        # chunks are whole bytes of sign bits.
        onebit = t.optimizer in ONEBIT_KINDS
        pad = ONEBIT_PAD if onebit else 1
        if not fsdp:
            self._materialize(model)
        if stage is not None:  # a schedule executor runs the micro-batches across stages
            # collective; multi-token prediction keeps an embedding copy on the last stage, tied or not
            emb_group = build_embedding_groups(mesh) if cfg.model.tie_embeddings or cfg.model.mtp_depth else None
            pipe, eval_pipe = self._pipeline_executors(stage)
            # Gradient buckets of the stage, reduced (zero 0) or reduce-scattered (zero 1/2) over dp as each chunk
            # finishes its last backward; the tied embedding's bucket then summed over the first and last stage.
            grads = build_data_parallel(model, mesh, cfg.parallel.zero, cfg.parallel.bucket_mb, gather_dtype,
                                        tied=tied_parameter(stage), tied_group=emb_group, pad_multiple=pad,
                                        low_precision_params=t.bf16_params is True)
        # Data parallelism: gradient buckets reduced during the last backward (zero 0), reduce-scattered into a
        # sharded optimizer (zero 1/2), or FSDP2-sharded parameters (zero 3). Built before compile: FSDP2 wraps blocks.
        elif rt.world_size > 1 or onebit or t.bf16_params is True:  # bf16 weights: fp32 grads in the buckets
            grads = build_data_parallel(model, mesh, cfg.parallel.zero, cfg.parallel.bucket_mb, gather_dtype,
                                        pad_multiple=pad, low_precision_params=t.bf16_params is True)
            if fsdp:  # FSDP2 wrapped the meta model: each rank allocates its dim-0 share of its tp shard only
                self._materialize(model)
        else:
            grads = None
        if t.grad_accum_fusion is True:  # before compile: the blocks' linears change
            if hasattr(grads, "enable_fusion"):
                n = grads.enable_fusion(model, embeddings=t.embedding_grad_fusion is True)
                log.debug(f"megaloom: {n} weight gradients accumulate into the data-parallel buckets in their GEMMs")
            else:  # one process (or FSDP2): no buckets; the gradients go to .grad as usual
                log.debug("megaloom: train.grad_accum_fusion: no gradient buckets to add into")
        if t.compile:
            set_lean_saves(t.recompute_casts)  # read when each block compiles, at its first call
            for layer in model.layers.values():
                layer.compile()  # in place: parameter names (and so checkpoints) stay the same
        t1 = time.perf_counter()
        self.build_seconds["wrappers"] = t1 - t0 - self.build_seconds["materialize"]
        if t.optimizer_offload:  # AdamW's state and fp32 masters on the host (megaloom/optim/offload.py)
            optimizer = build_offloaded(model, grads, t, device, cfg.parallel.zero,
                                        overlap=None if stage is None else False,
                                        whole_modules=list(model.layers.values()) if t.compile else ())
        elif onebit:
            optimizer = build_onebit(model, grads, t)
        elif t.optimizer == "muon" and cfg.parallel.zero >= 1:  # the momentum sharded as AdamW's state would be
            optimizer = ShardedMuon(grads, lr=t.lr, betas=(t.beta1, t.beta2), eps=1e-8, weight_decay=t.weight_decay,
                                    momentum=t.muon_momentum, ns_steps=t.muon_ns_steps,
                                    whole_modules=list(model.layers.values()) if t.compile else ())
        elif cfg.parallel.zero >= 1 or t.bf16_params is True:  # zero 0 with bf16 weights: every master here
            optimizer = ShardedOptimizer(grads, t.optimizer, lr=t.lr, betas=(t.beta1, t.beta2),
                                         eps=1e-8 if t.optimizer == "adamw" else 1e-6, weight_decay=t.weight_decay,
                                         whole_modules=list(model.layers.values()) if t.compile else ())
        else:
            optimizer = build_optimizer(model, t, device, mesh)
        if t.optimizer == "muon" and t.muon_qk_clip:  # MuonClip: the attention measures, each step ends clipping
            install_qk_clip(model, optimizer, t.muon_qk_clip, mesh)
        self.build_seconds["optimizer"] = time.perf_counter() - t1
        self.train_step = TrainStep(model, optimizer, self.precision, device, t.micro_batch_size, t.grad_clip, grads,
                                    nan_guard=cfg.resilience.nan_guard, pipeline=pipe, attention=t.attention,
                                    offload=t.offload_activations, documents=self.documents(),
                                    seq_shard=self.seq_shard, overlap_optimizer=t.overlap_optimizer,
                                    token_mean=self.masks_targets())
        self.model, self.optimizer, self.pipe, self.eval_pipe = model, optimizer, pipe, eval_pipe

    def _pipeline_executors(self, stage) -> tuple[PipelineExecutor, PipelineExecutor]:
        """The schedule executors that run this stage's micro-batches across the pipeline: the training schedule
        and a forward-only one for evaluation."""
        cfg, t, mesh = self.cfg, self.cfg.train, self.mesh
        auto = lambda: forward_ctx(self.precision, self.device, t.offload_activations)  # noqa: E731
        # the messages: the residual stream's dtype (fp32 unless bf16_residual, also with bf16 weights)
        residual = (torch.bfloat16 if t.bf16_residual is True else torch.float32 if t.bf16_params is True
                    else None) if self.precision != "fp32" else None
        pipe = PipelineExecutor(stage, build_schedule(cfg.parallel.schedule, mesh.pp, cfg.parallel.vpp, self.n_micro),
                                mesh, t.micro_batch_size, t.seq_len, sp=cfg.parallel.sp, autocast=auto,
                                dtype=residual, documents=self.documents(),
                                scatter_gather=cfg.parallel.pp_scatter_gather, inputs_and_labels=inputs_and_labels)
        eval_pipe = PipelineExecutor(stage, forward_only(mesh.pp, cfg.parallel.vpp, self.n_micro), mesh,
                                     t.micro_batch_size, t.seq_len, sp=cfg.parallel.sp, autocast=auto,
                                     dtype=residual, documents=self.documents(),
                                     scatter_gather=cfg.parallel.pp_scatter_gather,
                                     inputs_and_labels=inputs_and_labels)
        return pipe, eval_pipe

    def masks_targets(self) -> bool:
        """Whether some targets of the data are masked (-100): chat data (only the assistant's tokens), an
        encoder's objective (BERT's masked positions) or image-text rows. Then micro-batches hold different
        numbers of targets, and the step's loss weighs each target once (megaloom.parallel.token_mean)."""
        cfg = self.requested
        return cfg.data.format == "chat" or self.objective is not None or registry.reads_images(cfg.model)

    def documents(self):
        """data.document_mask / data.reset_positions: the boundaries of a micro-batch's packed documents, from its
        tokens and the tokenizer's end-of-document id (models/documents.py); None when neither is set."""
        d = self.cfg.data
        if not (d.document_mask or d.reset_positions):
            return None
        eod = self.tokenizer.eod_id
        return partial(Documents.from_tokens, eod_id=eod, mask=d.document_mask, reset_positions=d.reset_positions)

    def _materialize(self, model) -> None:
        t0 = time.perf_counter()
        materialize(model, self.device, self.mesh)  # this rank's slices only, initialised as the single process's
        self.build_seconds["materialize"] = time.perf_counter() - t0

    def _tp_overlap_route(self):
        """parallel.async_tp's route for this run (parallel/tp_overlap.py), said in the start-up lines; the
        compiled one switched on here, before any block compiles. An explicit true that cannot run is refused."""
        from megaloom.parallel import tp_overlap

        p, mesh = self.cfg.parallel, self.mesh
        backend = dist.get_backend() if dist.is_available() and dist.is_initialized() else "none"
        r = tp_overlap.route(p.async_tp, mesh.tp, p.sp, self.cfg.train.compile is True, self.device.type, backend)
        if p.async_tp is True and r.how == "off" and mesh.tp > 1 and backend != "fake":
            raise ConfigError(f"parallel.async_tp=true cannot run here: {r.why}. Set parallel.async_tp=auto or false "
                              "(or train.compile=false for the eager ring steps).")
        if r.how == "compiled":
            tp_overlap.enable(mesh.tp_group)
        if mesh.tp > 1:
            (log.info if self.rt.is_main else log.debug)(f"megaloom: tp overlap {r.how} ({r.why})")
        return r

    def _build_model(self, checked: Checked):
        """The model of the config's family on the meta device (no storage), split by its parallel plan, changed
        by train.* options and cut to this rank's pipeline stages there. The caller then allocates and
        initialises only this rank's slices, with the values the single process has in them
        (parallel/materialize.py). Returns (model, pipeline stage or None)."""
        cfg, t, mesh = self.cfg, self.cfg.train, self.mesh
        t0 = time.perf_counter()
        seed_everything(t.seed)  # the model's init seed: the same on every rank
        with torch.device("meta"):
            model = get_family(cfg.model.arch).build(cfg.model)
        self.n_params = count_params(model)
        # FLOPs on the full (meta) model; freezing here too only for the count (parallelising replaces parameters,
        # so it is applied again below).
        freeze_for_training(model, cfg.model)
        self.flops_per_token = flops_per_token(cfg.model, matmul_params(model), t.seq_len,
                                               frozen_matmul_params(model))
        self.image_flops = image_flops(model)  # per image through an image encoder (0 without one)
        overlap = self._tp_overlap_route()
        parallelize_tensor(model, mesh, cfg.parallel.sp, async_tp=overlap.how == "ring",
                           overlap=overlap.how == "compiled")
        parallelize_context(model, mesh, cfg)  # parallel.cp: attention over the cp ranks, positions of our chunks
        self.seq_shard = SequenceShard(mesh.cp, mesh.cp_rank) if mesh.cp > 1 else None
        # Selective recompute re-runs the attention core only where the kernel keeps the scores (math).
        kernel = attention_backend(cfg, self.device.type, cfg.parallel.tp)
        fp8_summary = apply_train_options(model, t, recompute_attention=kernel == "math",  # before stages, compile
                                          device=self.device)
        freeze_for_training(model, cfg.model)  # before the gradient buckets and the optimizer, which skip them
        if fp8_summary is not None:
            log.info(f"megaloom: {fp8_summary}")
        stage = build_stage(model, checked.partition, mesh) if mesh.pp > 1 else None  # prunes the model
        if cfg.model.lora.rank > 0:
            log.info(f"megaloom: {lora_summary(model, cfg.model.lora)}")
        self.build_seconds["model"] = time.perf_counter() - t0
        torch.manual_seed(dropout_seed(t.seed, mesh))  # dropout: equal across tp peers, distinct across data
        return model, stage

    def _resume(self) -> None:
        self.ckpt = RunCheckpoints(self.cfg, self.run_dir, self.rt, self.mesh, self.host, data=self.data_identity)
        self.step, resumed_state = self.ckpt.resume(self.model, self.optimizer)
        self.resumed_step, self._warm = self.step, False
        if self.train_step.scaler is not None and "loss_scaler" in resumed_state:
            self.train_step.scaler.load_state_dict(resumed_state["loss_scaler"])
        # After a rollback the data stream skips the window that produced non-finite steps: step s then reads
        # the batch of s + data_offset. Saved with every checkpoint, so resume stays exact.
        self.data_offset = int(resumed_state.get("data_offset", 0))

    def _start_observers(self) -> None:
        """Start-up lines and memory plan, evaluation batches, metrics sink, resilience, background saves."""
        cfg, t, rt, mesh = self.cfg, self.cfg.train, self.rt, self.mesh
        self.peak_flops = device_peak_flops(self.device)
        log.info(f"megaloom: {cfg.model.preset} ({cfg.model.arch}) {self.n_params / 1e6:.2f}M params on "
                 f"{self.device}, {self.precision}, {t.steps} steps x {t.global_batch_size} x {t.seq_len} tokens "
                 f"({self.n_micro} micro-batches of {t.micro_batch_size}); run dir {self.run_dir}")
        if t.warmup_steps > t.steps and rt.is_main:
            log.warning(f"WARNING: train.warmup_steps={t.warmup_steps} > train.steps={t.steps}: the learning rate "
                        f"never reaches train.lr={t.lr:g} (it ends at {lr_at(t.steps - 1, t):.3g}); lower "
                        "train.warmup_steps")
        # Predicted bytes per rank (weights, gradients, optimizer, activations), printed and written to memory.json;
        # compared with the measured peak after the first steps. Rank 0 plans its own stage; no forward is run.
        self.memory_report = MemoryReport.start(cfg, self.model, world_size=rt.world_size, device=self.device,
                                                pp_rank=mesh.pp_rank, n_micro=self.n_micro, run_dir=self.run_dir,
                                                enabled=rt.is_main)
        self.eval_batches = eval_batches(self.valid_ds, t.eval_batches, t.global_batch_size, self.local_batch, mesh,
                                         self.reads_data)
        self.sink = MetricsSink(self.run_dir, cfg.run.tensorboard and "tensorboard" in cfg.run.trackers,
                                enabled=rt.is_main, trackers=cfg.run.trackers, config=cfg.to_dict(),
                                project=cfg.run.project, mlflow_uri=cfg.run.mlflow_uri,
                                trackers_optional=cfg.run.trackers_optional)
        dropped = self.sink.truncate_after(self.step)  # steps after the resumed one are trained again: one row each
        if dropped:
            log.info(f"metrics.jsonl: {dropped} row(s) after the resumed step {self.step} removed (trained again)")
        self.result = TrainResult(run_dir=self.run_dir, final_step=self.step)
        self.guard = Resilience(cfg, self.run_dir, rt.rank, rt.world_size, mesh)
        self.stops = StopRequests(cfg.resilience.save_on_signal, self.guard.control,
                                  cfg.resilience.signal_check_every)
        self.saved_step: int | None = None  # the step of the last checkpoint this run wrote
        self.ckpt.start_background_saves()
        self.pending_stall: float | None = None  # the last save's stall, reported in the next metric record
        self.interval = Interval(loss_sum=torch.zeros((), device=self.device))
        self.skipped = 0
        self.rollbacks = RollbackBudget(cfg.resilience.max_rollbacks)

    # ------------------------------------------------------------------------------------------------- loop

    def fit(self, stop_after: int | None = None) -> TrainResult:
        """Train to train.steps. `stop_after` ends the work after that step as a preemption would (tests)."""
        if self.cfg is None:
            self.build()
        self.train_start = time.perf_counter()
        if self.step >= self.cfg.train.steps:  # a finished run started again: say so rather than exit silently
            log.info(f"run.dir {self.run_dir} already trained to step {self.step} of train.steps="
                     f"{self.cfg.train.steps}: nothing to do; raise train.steps to continue, or set "
                     "checkpoint.resume=none (or another run.dir) to start fresh")
        self.stops.install()  # SIGTERM/SIGUSR1/SIGINT now stop at a step boundary, after a save
        try:
            while self.step < self.cfg.train.steps:
                if not self._run_until_rollback(stop_after):
                    break
            self.stops.close()
            self.train_step.settle()  # the weights a caller reads after fit() are the last update's
            self.ckpt.wait()  # the last checkpoint is on disk before fit() returns
        except Exception as e:
            self._raise_if_peer_lost(e)
            raise
        finally:  # also when the run stops with an error: no watchdog left armed in a process that goes on
            self.stops.restore()
            self.guard.close()
            self.sink.close()
            self.run_lock.release()
        self.result.final_step = self.step
        if self.step >= self.cfg.train.steps and self.step > self.resumed_step:
            log.info(self._summary())
        return self.result

    def close(self) -> None:
        """The end of a process whose trainer started the process group itself (`megaloom train` under torchrun):
        every rank meets on the host group before any tears down, then the group goes. gloo aborts a process
        ("terminate called without an active exception": a chat cp2 x dp2 run of the CI, 2026-12-06, after its last
        step) when a peer closes its connections while it still has traffic in flight. A trainer given its runtime
        leaves the group to its owner (the test worlds meet and tear down themselves)."""
        if self._runtime is not None or self.cfg is None or not dist.is_initialized():
            return
        self.host.barrier()
        dist.destroy_process_group()

    def _raise_if_peer_lost(self, e: Exception) -> None:
        """A collective failed because another rank died: one line for the job naming it (said here, while a
        SIGTERM from torchrun tearing the job down is still only recorded), then PeerLost, not the backend's
        traceback (resilience/peers.py)."""
        pattern = peer_loss(e) if self.rt.world_size > 1 else None
        if pattern is None:
            return
        line = describe(pattern, self.rt.rank, self.rt.world_size, self.step, self.run_dir)
        if line:
            print(f"megaloom: stopped: {line}", file=sys.stderr, flush=True)
        raise PeerLost(line) from e

    def _summary(self) -> str:
        """One line at the end of a run: what was trained, how long it took, where the results are."""
        t, r = self.cfg.train, self.result
        steps = self.step - self.resumed_step
        took = format_eta(time.perf_counter() - self.train_start)
        loss = f"final loss {r.losses[max(r.losses)]:.4f}" if r.losses else "no loss logged"
        if r.eval_loss is not None:
            loss += f", eval {r.eval_loss:.4f}"
        ckpts = self.run_dir / "checkpoints"
        where = f"checkpoints in {ckpts}, " if any(ckpts.glob("step_*")) else ""
        return (f"megaloom: done: step {self.step}/{t.steps} ({steps} trained now, "
                f"{steps * t.global_batch_size * t.seq_len:,} tokens) in {took}; {loss}; {where}"
                f"metrics in {self.run_dir / 'metrics.jsonl'} (megaloom plot {self.run_dir})")

    def _run_until_rollback(self, stop_after: int | None) -> bool:
        """Step through the data from `self.step` on; True when a rollback restored an earlier step."""
        for batch in self._loader():
            if self._train_one_step(batch):
                self._roll_back()
                return True
            self._maybe_checkpoint()
            stop = self.stops.poll(self.step)  # the same answer on every rank
            if stop is not None:
                self._stop_for(stop)
                break
            if stop_after is not None and self.step >= stop_after:
                break
        return False

    def _loader(self):
        """The batches of steps `self.step + 1 ...` (shifted by the data offset), or Nones on middle stages."""
        cfg, t, step = self.cfg, self.cfg.train, self.step
        if self.data_offset and len(self.train_ds) < (t.steps + self.data_offset) * t.global_batch_size:
            self.train_ds, _, _ = load_rank_datasets(
                self._datasets, cfg.data, t.seq_len, t.seed, (t.steps + self.data_offset) * t.global_batch_size,
                t.eval_batches * t.global_batch_size, self.rt, self.reads_data,
                default=default_builder(cfg, build_datasets), host=self.host)
        batches = StepBatches(self.train_ds, t.global_batch_size, rank_offset=self.mesh.dp_rank * self.local_batch,
                              rank_size=self.local_batch, start_step=step + self.data_offset, n_steps=t.steps - step)
        if not self.reads_data:
            return itertools.repeat(None, t.steps - step)
        return batches_of(make_loader(batches, cfg.data.num_workers, cfg.data.prefetch,
                                      pin_memory=accelerator.pin_memory(self.device)))

    def _train_one_step(self, batch: torch.Tensor | None) -> bool:
        """One optimizer step, then its metric line if due; True when the run must roll back."""
        t, step_t0 = self.cfg.train, time.perf_counter()
        self.guard.before_step(self.step + 1, self.model, data_step=self.step + 1 + self.data_offset)
        if isinstance(batch, ImageTextBatch):  # counted on the host, before the copy: no sync
            self.interval.images += int(batch.n_images.sum())
        batch = batch.to(self.device, non_blocking=True) if batch is not None else None
        lr = lr_at(self.step, t)
        set_lr(self.optimizer, lr)
        if self.cfg.model.mtp_depth:  # multi-token prediction's weight, on the stage that holds it
            self.model.mtp_loss_weight = mtp_loss_weight_at(self.step + 1, t)
        timed = self.pipe is not None and self.step + 1 == self.cfg.parallel.timeline_step
        if timed:
            self.pipe.timing = True
        out = self.train_step(batch)
        if timed:
            self.pipe.timing = False
            draw_measured_timeline(self.pipe, self.mesh, self.run_dir, self.step + 1, self.rt.is_main)
        self.interval.loss_sum += out.loss
        self.skipped += int(out.skipped)
        self.step += 1
        self.interval.steps += 1
        if self.step % t.log_every == 0:
            accelerator.synchronize(self.device)  # so the interval's timing covers the device work it queued
        wall = time.perf_counter() - step_t0
        self.interval.compute_s += wall
        if not self._warm:
            self.interval.warmup_s, self._warm = wall, True
            self._end_start_up_timeouts()
        rollback = self.guard.after_step(self.step, out.skipped, wall)
        self._log(lr, out.grad_norm, self._check_stragglers())
        return rollback

    def _end_start_up_timeouts(self) -> None:
        """After this process's first step (compilation, communicator set-up): the training groups leave the long
        start-up timeout (resilience.init_timeout_s) for resilience.collective_timeout_s (runtime.shorten_timeouts).
        Before any background save exists, so the host group is the main thread's alone."""
        if self.rt.world_size > 1 and dist.get_backend() != "fake":
            shorten_timeouts(self.mesh.training_groups(), collective_timeout(self.cfg), self.host.barrier,
                             self.device)

    def _check_stragglers(self) -> dict | None:
        if not self.guard.stragglers_due(self.step):
            return None
        slow, times = self.guard.straggler.check()
        if slow and self.rt.is_main:
            nodes = self.guard.nodes
            log.warning(f"WARNING: straggler rank(s) {slow} (node(s) {sorted({nodes[r] for r in slow})}) at step "
                        f"{self.step}: compute s/step per rank {[round(x, 4) for x in times]}")
            suspects.record(self.run_dir, "straggler", self.step, {r: nodes[r] for r in slow},
                            f"compute s/step {[round(times[r], 4) for r in slow]}")
        return {"stragglers": slow, "compute_s_per_rank": times}

    # -------------------------------------------------------------------------------- log, evaluate, checkpoint

    def _log(self, lr: float, grad_norm: torch.Tensor, stragglers: dict | None) -> None:
        """The metric record of the interval (and the evaluation, when due): metrics.jsonl, TensorBoard, console."""
        t, step = self.cfg.train, self.step
        do_eval = (t.eval_every and step % t.eval_every == 0) or step == t.steps
        if not (step % t.log_every == 0 or do_eval or stragglers is not None):
            return
        record = self._record(lr, grad_norm)
        if stragglers is not None:
            record.update(stragglers)
        record.update(moe_fields(self.train_step.moe))
        mtp = getattr(self.model, "last_mtp_loss", None)
        if mtp is not None:  # the mean MTP loss of this rank's last micro-batch (a pipeline's last stage holds it)
            record["mtp_loss"] = float(mtp)
        if self.pending_stall is not None:  # the save's stall, and the update's wait for an in-place write
            record["ckpt_stall_s"], self.pending_stall = self.pending_stall + self.ckpt.update_wait_s(), None
        if do_eval:
            record.update(self._evaluate())
        self.sink.log(record)
        self.result.losses[step] = record["loss"]
        eta = (t.steps - step) * self.interval.seconds_per_step()
        line = console_line(record, t.steps, eta)
        if do_eval:
            line += f" | eval {record['eval_loss']:.4f} (ppl {record['eval_ppl']:.1f})"
        log.info(line)
        if self.memory_report is not None:
            self.memory_report.after_step(step, t.steps)
        self.interval.reset()

    def _record(self, lr: float, grad_norm: torch.Tensor) -> dict:
        t, step, iv = self.cfg.train, self.step, self.interval
        tps = iv.steps * t.global_batch_size * t.seq_len / max(iv.compute_s, 1e-9)
        peak = self.peak_flops
        # Images through an encoder: this rank's count times the data-parallel ranks (each reads its own rows).
        image_fps = self.image_flops * iv.images * self.mesh.dp / max(iv.compute_s, 1e-9)
        return {"step": step, "loss": dp_mean(iv.loss_sum / iv.steps, self.mesh), "lr": lr,
                "grad_norm": float(grad_norm), "tokens_per_s": tps,
                "mfu": ((self.flops_per_token * tps + image_fps) / (peak * self.rt.world_size)) if peak else None,
                "mem_gb": peak_memory_gb(self.device), "tokens": step * t.global_batch_size * t.seq_len,
                "skipped_steps": self.skipped, "elapsed_s": time.perf_counter() - self.train_start}

    def _evaluate(self) -> dict:
        """Mean validation loss over the data-parallel replicas (the watchdog paused: evaluation is no step)."""
        t = self.cfg.train
        with self.guard.paused():
            ev = (evaluate(self.model, self.eval_batches, t.micro_batch_size, self.precision, self.device,
                           self.train_step.documents, self.seq_shard)
                  if self.eval_pipe is None else evaluate_pipeline(self.eval_pipe, self.eval_batches))
        loss = dp_mean(torch.tensor(ev, device=self.device), self.mesh)
        self.result.eval_loss = loss
        return {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 50.0))}

    def _maybe_checkpoint(self) -> None:
        c, step = self.cfg.checkpoint, self.step
        last = step == self.cfg.train.steps
        due = c.every and step % c.every == 0
        if due and self.guard.bad_in_a_row and not last:
            due = False  # never checkpoint inside a run of non-finite steps: a rollback must go before it
        if due or (last and c.final):
            self._save()

    def _save(self) -> None:
        self.train_step.settle()  # train.overlap_optimizer: the last update is complete before the weights are read
        with self.guard.paused():
            self.pending_stall = self.ckpt.save(self.step, self.model, self.optimizer, self.train_step,
                                                self.data_offset)
        self.saved_step = self.step

    def _stop_for(self, signum: int) -> None:
        """Every rank agreed to stop for `signum` at this step: save it (unless just saved, or inside a run of
        non-finite steps, which a rollback must go before); fit() then waits for the write and returns."""
        if self.saved_step != self.step and not self.guard.bad_in_a_row:
            self._save()
        self.result.stopped_by = signal_name(signum)

    def _roll_back(self) -> None:
        """resilience.max_bad_steps non-finite steps in a row: restore the newest good checkpoint and skip the
        data window that produced them (it is never seen again); stop instead when another rollback would not help
        (resilience/rollbacks.py)."""
        step, r, t = self.step, self.cfg.resilience, self.cfg.train
        self.ckpt.wait()  # a background save in flight is on disk (or has failed) before the newest is chosen
        self.train_step.settle()  # no overlapped update still writing the weights the restore overwrites
        self.rollbacks.allow(step, r.max_bad_steps, self.ckpt.newest_step(),
                             f"lower train.lr (now {t.lr:g}) or raise train.warmup_steps, or check the data")
        back_to = self.ckpt.rollback(self.model, self.optimizer)
        self.data_offset += step - back_to
        if self.rt.is_main:
            log.warning(f"ROLLBACK: {self.cfg.resilience.max_bad_steps} non-finite steps in a row up to step {step}; "
                        f"restored step {back_to} and skipping the data of steps {back_to + 1}..{step} "
                        f"(data offset now {self.data_offset} steps)")
        self.step, self.guard.bad_in_a_row = back_to, 0
        self.sink.truncate_after(back_to)  # the steps after it are trained again on other data: one row per step
        self.interval.reset()
