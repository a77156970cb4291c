"""The memory report: predicted bytes per rank for weights, gradients, optimizer state and activations.

Three modules by concern: `memory_params.py` (the resident state: parameters, gradients, optimizer state, host
buffers of a save), `memory_activations.py` (what each micro-batch saves for backward, block by block) and this
one (the rank's layout, the step's events played in order to find the peak, and the report).

`plan_memory(cfg, model)` is called at start-up, after the model is built, parallelised and (with pipelines)
cut into this rank's stage; it counts this rank's parameters exactly from the module and everything else
from the config. No forward pass is run. The trainer prints `MemoryPlan.table()` and, after the first
steps, the prediction next to the device allocator's peak (`accelerator.max_memory_allocated`).

Persistent state (megaloom keeps fp32 parameters and runs bf16/fp16 under autocast):

  weights      4 bytes x this rank's parameters (ZeRO-3: its 1/dp shard; train.bf16_params: 2 for the trained ones)
  gradients    fp32. One process or pipelines: ``p.grad``, allocated during the first backward of a step and
               freed by ``zero_grad(set_to_none=True)`` after it. Data parallel (megaloom.parallel.data_parallel):
               flat fp32 buckets, persistent with zero 0/1 (zero 1 reduce-scatters in place: its reduced 1/dp
               chunk is part of the bucket); zero 2 keeps the reduced 1/dp ``grad_shard`` apart and frees the
               buckets after their reduction; zero 3 (FSDP2) keeps 1/dp sharded gradients
  optimizer    AdamW / LAMB: exp_avg + exp_avg_sq, 8 bytes per parameter (divided by dp under zero>=1); 1-bit
               Adam / LAMB (zero 0, buckets even in one process): the same, LAMB's fresh variance (4 more), and
               where a bucket's group has several ranks the exchange's errors: the worker error of every element
               (4) and the server error of this rank's chunk (4 / the group's size)
  ckpt (host)  checkpoint.async_save: on a GPU, the pinned host copy of what this rank's checkpoint writes (its
               parameters, with ZeRO-1/2 its own 1/dp segment of them, and its optimizer state), reused by every
               save: host memory, reported beside the device's peak, not in it. On CPU nothing: the state is
               written where it lives (the next update waits for the write)

Activations, saved for backward per micro-batch, enumerated from what megaloom's own modules save (verified
tensor by tensor with saved-tensor hooks, tests/planning/test_memory_plan.py; one block of every registered
family, tests/planning/test_family_memory_plan.py). The model's shape comes from its family's traits
(`megaloom.models.family.Traits`: norm kind, gated MLP, biases, positions, QK-norm), never from its name. Per
block, with n tokens per micro-batch on this rank (micro_batch x seq_len / cp), n_r = n / tp in
sequence-parallel regions, a = 2 bytes under autocast (4 in fp32):

  norms        the fp32 residual input + 1/rms (+ mean for LayerNorm); RMSNorm on CPU is PyTorch's composite
               and also keeps the normalised x (4 bytes x n_r x d more); CUDA runs the fused kernel
  QK-norm      per-head RMSNorms of q and k (Traits.qk_norm): bf16 heads with an fp32 weight take the composite
               in fp32 on CPU and CUDA (8 bytes x n x (h + h_kv)/tp x head_dim + 1/rms)
  linears      under autocast every linear casts its fp32 input to bf16 and saves that cast: q, k, v read the
               same normed x but each saves its own copy (3 x 2nd), gate/up two more; in fp32 they share it.
               With sp (tp > 1) a region's column-parallel linears save one shard instead: a x n_r x d
               (megaloom.parallel.sp_linear), and so does the head
  attention    flash / cuDNN / efficient (GPU) and the CPU flash kernel: q, k, v, out (o_proj reads `out`
               through a view) and the fp32 logsumexp; the math backend keeps the [b, h, s, s] probabilities
  MLP          SwiGLU: gate, up, silu(gate), their product (4 x a x n x ffn/tp); GeLU: up, gelu(up)
  MoE          router (probs, top-k, weights), the dispatch index, per-row expert inputs and hidden states,
               the fp32 combine; dropless, so every token's top_k rows are counted
  recompute    selective: the attention core (its logsumexp / probabilities) and the SwiGLU activation are
               recomputed, their inputs stay; full: only each block's input (4 x n_r x d; 2 x n_r x d with
               train.bf16_residual) is kept, and one block's full activations live again while it is recomputed
  bf16 residual  train.bf16_residual: the stream between blocks is bf16; each norm reads an fp32 copy of it and
               saves that copy, so the norms' bytes above are unchanged

plus the embedding (token ids) and the head: final norm, the head's input cast, and the loss. The largest
transients are in the loss: logits [n, vocab/tp] in the compute dtype, their fp32 copy and log-softmax
output (10 x n x V bytes under bf16 in the forward), and log-softmax's saved output plus two fp32 gradients
(12 x n x V) in its backward; the vocabulary-parallel loss (tp > 1) needs 10 x n x V/tp. For llama3's 128k
vocabulary this is usually the single largest term.

Autocast caches the bf16 copy of every fp32 weight it casts until the autocast region ends, and the matmuls
save those copies for backward: 2 bytes x matmul parameters per micro-batch in flight ("weight casts"). With
full recomputation they are only cached during the forward and recast block by block in backward.

Peak model. The step is played as a sequence of events: forwards and backwards of the micro-batches in this
rank's order (F0 B0 F1 B1 ... without a pipeline; the pipeline schedule's list for this rank otherwise, so 1F1B's
first stage holds up to pp micro-batches), then the optimizer step. At each event the live bytes are: the
persistent state, gradients once a backward of the step has produced them, the saved activations and weight
casts of every micro-batch in flight, and the event's transient (the loss forward / backward, a recomputed
block, the head's weight gradient). The end of each backward is an event too: all gradients exist by then while
the other micro-batches' activations are still held (the peak of a stage that runs all its forwards before its
first backward), and from the second backward through the first virtual stage on, the embedding's dense fp32
gradient waits to be added into .grad. The optimizer step adds its temporaries (foreach AdamW on CPU: one fp32
copy of the state, or with ZeRO of one parameter group of megaloom.parallel.data_parallel.STEP_GROUP_ELEMENTS;
LAMB: the update of every parameter). The predicted peak is the largest event; which one
it is is reported with it. Steady state is assumed (optimizer state exists, i.e. from the second step on);
``update=False`` plans steps that never call the optimizer (a dry run that leaves the update out).

torch.compile (train.compile) changes what is saved: for compiled dense decoder blocks (RMSNorm, SwiGLU, RoPE,
QK-norm or not, fused attention, no or selective recompute, any tp with or without sp, any cp in either mode) the
plan counts the partitioner's own save-set (`_compiled_block_bytes`, checked against compiled blocks' saved
tensors at tp 1 and tp 2, and at cp 2 with tp 1 and 2), with train.recompute_casts the leaner one; other
compiled blocks are planned as eager, which over-estimates them.

Not modelled: the CUDA caching allocator's rounding and fragmentation (the comparison is with
max_memory_allocated, not reserved), cuBLAS workspaces, the gradient temporaries inside one block's backward,
and NCCL buffers. fp8 is approximated (converted linears save a 1-byte input, no weight cast).
"""

from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass, field

from torch import nn

from megaloom.accelerator import CUDA, compute_precision, fused_optimizer, is_accelerator, is_cuda
from megaloom.config import Config
from megaloom.models.attention_kernel import attention_backend
from megaloom.observe.log import get_logger
from megaloom.planning.levers import resolve_levers
from megaloom.planning.memory_activations import (
    _compiled_save_set_known,
    _dims,
    _resolved,
    _traits,
    block_activation_bytes,
    embedding_activation_bytes,
    fused_loss,
    head_activation_bytes,
    is_moe_layer,
    loss_transients,
    mtp_activation_bytes,
)
from megaloom.planning.memory_params import (
    ParamCounts,
    RankLayout,
    _largest_segment,
    _persistent_state,
    _State,
    analytic_params,
    bf16_params,
    count_model_params,
    master_shards,
)

log = get_logger(__name__)
GB = 1e9  # the report's unit, as megaloom.observe.memory.peak_memory_gb
_ATTN_NAMES = {"flash": "flash/cuDNN", "efficient": "mem-efficient", "math": "math"}
PHASES = ("forward", "loss forward", "loss backward", "head backward", "backward", "recompute", "optimizer step")



@dataclass
class MemoryPlan:
    """Predicted bytes per rank. The categories are what the table shows; ``peak`` = max over ``phases``."""

    weights: int
    gradients: int
    optimizer: int
    activations: int  # saved for backward, all micro-batches in flight when the most are
    weight_casts: int  # autocast's bf16 weight copies of the micro-batches in flight (transient)
    loss_transient: int  # the largest loss/logits transient (beyond the saved log-softmax)
    step_transient: int  # optimizer-step temporaries
    workspace: int  # CUDA library workspaces (cuBLAS), persistent
    checkpoint_host: int  # host bytes an async save adds (GPU: the pinned copy; CPU: none, written in place)
    peak: int
    peak_phase: str
    phases: dict[str, int]
    per_layer: dict[str, int]  # one block's saved bytes by what saves them (the first block of this rank)
    layers: int  # blocks on this rank
    in_flight: int  # micro-batches (x chunks) whose activations are held at the peak of activations
    setup: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    measured_peak: int | None = None
    # The build's peak (before the first step): the weights, the gradient buckets and ZeRO's fp32 master shard
    # that the build allocates, and one parameter's initialisation temporary (the largest).
    build: int = 0
    optimizer_host: int = 0  # train.optimizer_offload: host bytes of the masters, moments and gradient buffers

    def table(self) -> str:
        s = self.setup
        cp = f"cp={s.get('cp')} " if s.get("cp", 1) > 1 else ""
        head = (f"memory plan, per rank ({s.get('preset', '?')}, {s.get('precision')}, recompute={s.get('recompute')},"
                f" micro-batch {s.get('micro_batch_size')} x {s.get('seq_len')}, tp={s.get('tp')} pp={s.get('pp')} "
                f"{cp}dp={s.get('dp')} zero={s.get('zero')}, attention {self.attention_name()}):")
        layer = sum(self.per_layer.values())
        rows = [
            ("weights", self.weights, f"fp32 master parameters ({s.get('params_local', 0) / 1e6:.1f}M on this rank"
                                      + (f" training, {s['params_frozen'] / 1e6:.1f}M frozen)" if s.get("params_frozen")
                                         else ")")),
            ("gradients", self.gradients, s.get("grad_note", "fp32")),
            ("optimizer", self.optimizer, "muon: blocks' momentum, AdamW's moments for the rest (fp32), one matrix's "
             "gather" if s.get("optimizer") == "muon" else f"{s.get('optimizer')} exp_avg + exp_avg_sq (fp32)"
             + (" + 1-bit error feedback, variance window" if str(s.get("optimizer")).startswith("onebit") else "")),
            ("activations", self.activations, f"saved for backward: {self.layers} blocks x {layer / GB:.3f} GB + "
                                              f"embedding/head {s.get('embedding_head_bytes', 0) / GB:.3f} GB per "
                                              f"micro-batch, {self.in_flight} in flight"),
            ("weight casts", self.weight_casts, "autocast's bf16 weight copies (one set per micro-batch in flight)"),
            ("loss transient", self.loss_transient, "logits and fp32 loss gradients (largest moment)"),
            ("step transient", self.step_transient, "optimizer-step temporaries"),
            ("workspaces", self.workspace, "cuBLAS, 32 MiB per thread running matmuls"),
            *([("opt (host)", self.optimizer_host, "train.optimizer_offload: fp32 masters + exp_avg + exp_avg_sq + "
                                                   "gradient landing buffer, pinned host memory (not in the peak)")]
              if self.optimizer_host else []),
            ("ckpt (host)", self.checkpoint_host,
             "async saves: pinned host copy of this rank's share (host memory, not in the peak)"
             if is_accelerator(s.get("device", "")) else "async saves write the state in place (no copy)"),
        ]
        lines = [head]
        for name, v, what in rows:
            lines.append(f"  {name:<15}{v / GB:9.2f} GB  {what}")
        lines.append(f"  {'peak':<15}{self.peak / GB:9.2f} GB  at the {self.peak_phase}")
        if self.measured_peak is not None:
            lines.append(f"  {'measured':<15}{self.measured_peak / GB:9.2f} GB  ({self.error_pct():+.1f}% predicted "
                         "vs measured)")
        for note in self.notes:
            lines.append(f"  note: {note}")
        return "\n".join(lines)

    def attention_name(self) -> str:
        name = _ATTN_NAMES.get(self.setup.get("attention"), "?")
        return "flash (CPU kernel)" if name == "flash/cuDNN" and not is_cuda(self.setup.get("device", "")) else name

    def error_pct(self) -> float:
        if not self.measured_peak:
            return float("nan")
        return 100.0 * (self.peak - self.measured_peak) / self.measured_peak

    def as_dict(self) -> dict:
        d = asdict(self)
        d["unit"] = "bytes"
        d["peak_gb"] = self.peak / GB
        if self.measured_peak is not None:
            d["measured_peak_gb"] = self.measured_peak / GB
            d["error_pct"] = round(self.error_pct(), 2)
        return d

    def to_json(self) -> str:
        return json.dumps(self.as_dict(), indent=1)


def _rank_events(cfg: Config, pp: int, vpp: int, pp_rank: int, n_micro: int) -> tuple[list[tuple[str, int, int]], int]:
    """This rank's compute actions as (kind, micro-batch, virtual stage), and the last virtual stage."""
    if pp == 1:
        return [e for i in range(n_micro) for e in (("F", i, 0), ("B", i, 0))], 0
    return list(_schedule_events(cfg.parallel.schedule, pp, vpp, n_micro, pp_rank)), pp * vpp - 1


@functools.lru_cache(maxsize=512)
def _schedule_events(name: str, pp: int, vpp: int, n_micro: int, pp_rank: int) -> tuple[tuple[str, int, int], ...]:
    """A schedule's compute actions of one rank (built once per shape: a layout search plans many layouts that share
    their pipeline, megaloom/planning/search.py)."""
    from megaloom.parallel.pipeline.schedules import build_schedule

    schedule = build_schedule(name, pp, vpp, n_micro)
    return tuple((a.kind.value, a.microbatch, a.stage) for a in schedule.ranks[pp_rank] if not a.is_comm)


def plan_memory(cfg: Config, model: nn.Module | None = None, *, world_size: int = 1, device: str = CUDA,
                pp_rank: int = 0, n_micro: int | None = None, update: bool = True) -> MemoryPlan:
    """Predict this rank's memory for ``cfg`` (model shape resolved: vocab_size > 0).

    ``model``: this rank's built, parallelised (and staged) module, whose parameters are counted exactly;
    without it they are counted from the config. ``world_size``: the number of processes (dp = world /
    (tp * pp * cp)); ``device``: a device type, CUDA's (its kernels' save-sets) or "cpu" (the portable ones, which
    another accelerator is planned with: unverified there); ``pp_rank``: this rank's
    pipeline stage; ``n_micro``: micro-batches per step on this rank (default from the config); ``update=False``:
    steps that never call ``optimizer.step()`` (a dry run that leaves the update out to fit a machine), so no
    optimizer state and no update temporaries; the "optimizer step" phase is then the gradient reduction and
    clipping that end the step.
    """
    lay = _layout(cfg, world_size, device, pp_rank, n_micro, update)
    rank = _rank_model(lay, model)
    blocks = _Blocks(lay, rank.counts, rank.position, _fp8_layers(lay))
    acts = _stage_activations(lay, rank, blocks)
    state = _persistent_state(lay, rank.counts)
    step_transient = _step_transient(lay.cfg, device, state.p_opt, rank.counts.largest, lay.tp, lay.pp, lay.dp,
                                     state.buckets, update, zero=lay.zero)
    peaks = _play_events(lay, rank, acts, state, step_transient)
    peak_phase = max(peaks.phases, key=lambda k: peaks.phases[k])
    loss_transient = max(acts.loss["loss forward"], acts.loss["loss backward"]) if rank.has_head else 0
    first = rank.layers[0] if rank.layers else 0
    return MemoryPlan(weights=state.weights, gradients=state.gradients, optimizer=state.optimizer,
                      activations=peaks.activations, weight_casts=peaks.weight_casts, loss_transient=loss_transient,
                      step_transient=step_transient, workspace=state.workspace,
                      checkpoint_host=state.checkpoint_host, optimizer_host=state.optimizer_host,
                      peak=peaks.phases[peak_phase],
                      peak_phase=peak_phase, phases=peaks.phases, per_layer=blocks.saved(first),
                      layers=len(rank.layers), in_flight=peaks.in_flight,
                      setup=_setup(lay, rank, acts, _grad_note(lay.zero, state)), notes=_notes(lay, rank.counts),
                      build=_build_peak(lay, rank.counts, state))


def _build_peak(lay: RankLayout, counts: ParamCounts, state: _State) -> int:
    """What building this rank holds at most: its weights, the gradient buckets the data-parallel wrapper
    allocates at once (zero 0/1; zero 2 allocates them at the first backward), ZeRO's fp32 master shard (made
    with the optimizer; its moments come at the first step) and the largest parameter's initialisation
    temporary (models/init.py draws each tensor's values, then copies them into place)."""
    master = 4 * state.p_opt if state.optimizer > 8 * state.p_opt else 0
    return state.weights + state.grad_persistent + master + 4 * counts.largest


def _layout(cfg: Config, world_size: int, device: str, pp_rank: int, n_micro: int | None,
            update: bool = True) -> RankLayout:
    m, p, t = cfg.model, cfg.parallel, cfg.train
    if m.vocab_size <= 0:
        raise ValueError("plan_memory: model.vocab_size must be resolved (> 0) first")
    tp, pp, cp = p.tp, p.pp, p.cp
    dp = max(1, world_size // (tp * pp * cp))
    if n_micro is None:
        n_micro = max(1, t.global_batch_size // (dp * t.micro_batch_size))
    precision = compute_precision(cfg, device)
    if precision != t.precision:
        cfg = _with_precision(cfg, precision)
    cfg = resolve_levers(cfg, device)[0]  # compile / fused loss "auto": as training on `device`
    return RankLayout(cfg=cfg, device=device, world_size=world_size, tp=tp, pp=pp, vpp=p.vpp, cp=cp, dp=dp,
                   zero=p.zero, pp_rank=pp_rank, n_micro=n_micro, precision=precision,
                   tokens=t.micro_batch_size * t.seq_len // cp, batch=t.micro_batch_size, sp=p.sp and tp > 1,
                   attention=attention_backend(cfg, device, tp), update=update)


@dataclass(frozen=True)
class _RankModel:
    """This rank's share of the model: its blocks by virtual stage, its compute events and its parameters."""

    stages: dict[int, list[int]]  # virtual stage -> block indices
    last: int  # the model's last virtual stage (head and loss)
    events: list[tuple[str, int, int]]  # (kind, micro-batch, virtual stage), see `_rank_events`
    counts: ParamCounts

    @property
    def layers(self) -> list[int]:
        return [i for ls in self.stages.values() for i in ls]

    @property
    def position(self) -> dict[int, int]:
        """Block index -> its place within its stage (recompute_layers counts per stage)."""
        return {i: j for ls in self.stages.values() for j, i in enumerate(ls)}

    @property
    def has_embedding(self) -> bool:
        return 0 in self.stages

    @property
    def has_head(self) -> bool:
        return self.last in self.stages


def _rank_model(lay: RankLayout, model: nn.Module | None) -> _RankModel:
    """This rank's stages (the pipeline partition), events and parameter counts: exact from ``model``, from the
    config without it (or for a module without named blocks)."""
    m, p = lay.cfg.model, lay.cfg.parallel
    if lay.pp > 1:
        from megaloom.parallel.pipeline.partition import partition_layers

        part = partition_layers(m.n_layers, lay.pp, lay.vpp, p.pp_first_stage_layers or None,
                                p.pp_last_stage_layers or None)
        stages = {s: list(part.layers(s)) for s in part.stages_of_rank(lay.pp_rank)}
    else:
        stages = {0: list(range(m.n_layers))}
    events, last = _rank_events(lay.cfg, lay.pp, lay.vpp, lay.pp_rank, lay.n_micro)
    layers = [i for ls in stages.values() for i in ls]
    has_embedding, has_head = 0 in stages, last in stages
    counts = count_model_params(model) if model is not None else None
    if counts is None or (not counts.matmul_layers and layers):  # no module, or one without named blocks
        counts = analytic_params(lay.cfg, layers, has_embedding, has_head, lay.tp, p.ep)
    return _RankModel(stages, last, events, counts)


def _fp8_layers(lay: RankLayout) -> frozenset[int]:
    """fp8: the blocks whose linears save a 1-byte input and no weight copy (first/last kept in bf16 by default)."""
    if lay.precision != "fp8":
        return frozenset()
    m = lay.cfg.model
    keep = getattr(lay.cfg.train, "fp8_keep_first_last", True)
    return frozenset(i for i in range(m.n_layers) if not (keep and i in (0, m.n_layers - 1)))


@dataclass(frozen=True)
class _Blocks:
    """One block of this rank, one micro-batch: what it saves and the weight casts it holds. recompute=full with
    recompute_layers=N: only the first N blocks of each stage recompute, the others keep everything."""

    lay: RankLayout
    counts: ParamCounts
    position: dict[int, int]  # block index -> its place within its stage
    fp8: frozenset[int]

    def recomputed(self, i: int) -> bool:
        t = self.lay.cfg.train
        n_recompute = getattr(t, "recompute_layers", 0) or None
        return t.recompute == "full" and (n_recompute is None or self.position[i] < n_recompute)

    def saved(self, i: int, mode: str | None = None) -> dict[str, int]:
        lay = self.lay
        if mode is None and lay.cfg.train.recompute == "full" and not self.recomputed(i):
            mode = "none"
        return block_activation_bytes(lay.cfg, tokens=lay.tokens, batch=lay.batch, layer=i, tp=lay.tp, sp=lay.sp,
                                      device=lay.device, recompute=mode, attention=lay.attention, fp8=i in self.fp8)

    def casts(self, i: int) -> int:
        if not self.lay.autocast or bf16_params(self.lay):  # bf16 weights: autocast's cast is the weight itself
            return 0
        cfg = self.lay.cfg
        if getattr(cfg.train, "recompute_casts", False) is True and cfg.train.compile is True:
            return 0  # compiled blocks recast in backward (training/compile_saves.py): no copy is kept
        if i in self.fp8:  # converted linears quantise from the fp32 weight: no cached copy
            keep_attention = getattr(cfg.train, "fp8_keep_attention", False)
            converted = _fp8_linear_params(cfg, self.lay.tp, is_moe_layer(cfg.model, i), keep_attention)
            return 2 * max(0, self.counts.matmul_layers.get(i, 0) - converted)
        return 2 * self.counts.matmul_layers.get(i, 0)


@dataclass(frozen=True)
class _Activations:
    """Per virtual stage of this rank (one micro-batch): saved bytes, the blocks' weight casts (all, and those kept
    for backward), one recomputed block's transient; and the embedding's, the head's and the loss's bytes."""

    saved: dict[int, int]
    casts: dict[int, int]
    saved_casts: dict[int, int]
    recompute: dict[int, int]
    embedding: int
    head: int
    head_cast: int  # the head's weight cast, saved for backward
    loss: dict[str, int]  # `loss_transients`
    offload: bool  # activation offload: the blocks' saved tensors wait in host memory


def _stage_activations(lay: RankLayout, rank: _RankModel, blocks: _Blocks) -> _Activations:
    cfg, t = lay.cfg, lay.cfg.train
    full = t.recompute == "full"
    emb = sum(embedding_activation_bytes(cfg, tokens=lay.tokens, batch=lay.batch, tp=lay.tp,
                                         device=lay.device).values())
    head = sum(head_activation_bytes(cfg, tokens=lay.tokens, tp=lay.tp, sp=lay.sp, device=lay.device).values())
    head_cast = 2 * rank.counts.matmul_head if (lay.autocast and rank.has_head and not fused_loss(cfg)
                                                and not bf16_params(lay)) else 0
    if rank.has_head and cfg.model.mtp_depth:  # multi-token prediction runs with the head: its saves and casts
        head += sum(mtp_activation_bytes(cfg, tokens=lay.tokens, batch=lay.batch, tp=lay.tp, sp=lay.sp,
                                         device=lay.device).values())
        head_cast += 2 * rank.counts.matmul_mtp if lay.autocast and not bf16_params(lay) else 0
    loss = loss_transients(cfg, tokens=lay.tokens, tp=lay.tp, device=lay.device)
    saved, casts, saved_casts, recompute = {}, {}, {}, {}
    # Activation offload: the blocks' saved tensors wait in host memory; one block's come back during its backward.
    offload = bool(getattr(t, "offload_activations", False)) and is_cuda(lay.device)
    for s, ls in rank.stages.items():
        act = 0 if offload else sum(sum(blocks.saved(i).values()) for i in ls)
        act += emb if s == 0 else 0
        act += head if s == rank.last else 0
        if lay.pp > 1 and s != rank.last:
            act += 4 * lay.n_r * cfg.model.d_model  # the executor keeps the stage output until its backward
        saved[s] = act
        casts[s] = sum(blocks.casts(i) for i in ls)
        saved_casts[s] = sum(blocks.casts(i) for i in ls if not blocks.recomputed(i))  # recomputed blocks save none
        recompute[s] = max((sum(blocks.saved(i, "none").values()) + blocks.casts(i) for i in ls
                            if blocks.recomputed(i)), default=0) if full else 0
        if offload:
            recompute[s] = max([recompute[s]] + [sum(blocks.saved(i).values()) for i in ls])
    return _Activations(saved, casts, saved_casts, recompute, emb, head, head_cast, loss, offload)


@dataclass(frozen=True)
class _Peaks:
    phases: dict[str, int]  # the largest live bytes per phase (PHASES)
    activations: int  # saved bytes of the micro-batches in flight, at their largest
    weight_casts: int  # the weight casts live at that moment
    in_flight: int  # how many micro-batches (x chunks) were in flight then


def _play_events(lay: RankLayout, rank: _RankModel, acts: _Activations, state: _State, step_transient: int) -> _Peaks:
    """Play this rank's forwards and backwards, then the optimizer step; the live bytes at each event."""
    full = lay.cfg.train.recompute == "full"
    last, lt = rank.last, acts.loss
    stage_grads = _stage_gradients(rank, state)
    phases = {k: 0 for k in PHASES}
    live: dict[tuple[int, int], tuple[int, int]] = {}  # (mb, stage) -> (saved bytes, weight casts)
    started: set[int] = set()  # virtual stages whose backward has run in this step
    # The embedding's backward writes a dense fp32 gradient of its weight, added into .grad when one exists:
    # from the second backward on, or from the first when .grad is a view into a persistent bucket.
    embedding_grad = state.buckets and rank.has_embedding
    emb_dense = 4 * rank.counts.embedding if rank.has_embedding else 0
    max_act, max_casts, max_inflight = 0, 0, 0
    for kind, mb, s in rank.events:
        grads = sum(stage_grads[x] for x in started)
        if kind == "F":
            saved_casts = acts.saved_casts[s] + (acts.head_cast if s == last else 0)
            live[(mb, s)] = (acts.saved[s], saved_casts)
            saved = sum(v[0] for v in live.values())
            casts = sum(v[1] for v in live.values()) + acts.casts[s] - acts.saved_casts[s]  # cached until exit
            if saved >= max_act:
                max_act, max_casts, max_inflight = saved, casts, len(live)
            base = state.static + grads + saved + casts + state.fsdp_gather
            phases["forward"] = max(phases["forward"], base)
            if s == last:
                phases["loss forward"] = max(phases["loss forward"], base + lt["loss forward"])
        else:  # B, BI (ZB-H1's BW only finishes what BI began: counted with it)
            if (mb, s) not in live:
                continue
            saved = sum(v[0] for v in live.values())
            casts = sum(v[1] for v in live.values())
            base = state.static + grads + saved + casts + state.fsdp_gather
            if s == last:
                phases["loss backward"] = max(phases["loss backward"], base + lt["loss backward"])
                phases["head backward"] = max(phases["head backward"], base + lt["head backward"])
            if full or acts.offload:
                phases["recompute"] = max(phases["recompute"], base + acts.recompute[s])
            del live[(mb, s)]
            started.add(s)
            # Its end: this stage's gradients exist (its first backward allocates them), the other micro-batches'
            # saved tensors are still held. The peak of a stage that runs all its forwards first (GPipe, or 1F1B/
            # interleaved with few micro-batches on the first stages). The first virtual stage ends with the
            # embedding's backward, whose dense gradient is added into an existing .grad from the second on.
            grads = sum(stage_grads[x] for x in started)
            after = state.static + grads + state.fsdp_gather + sum(v[0] + v[1] for v in live.values())
            phases["backward"] = max(phases["backward"], after + (emb_dense if s == 0 and embedding_grad else 0))
            embedding_grad = embedding_grad or (s == 0 and rank.has_embedding)
    phases["optimizer step"] = state.static + state.grad_at_step + step_transient
    return _Peaks(phases, max_act, max_casts, max_inflight)


def _stage_gradients(rank: _RankModel, state: _State) -> dict[int, int]:
    """Gradient bytes each virtual stage adds when its first backward of the step runs. p.grad (pipelines, one
    process): a rank with several chunks (interleaved) holds only the started chunks' ones; the embedding goes with
    the first virtual stage, the final norm and head with the last. Buckets / FSDP2 shards: all at once."""
    counts, stages, last = rank.counts, rank.stages, rank.last
    grads = {s: 4 * sum(counts.block_params.get(i, 0) for i in ls) for s, ls in stages.items()}
    rest = state.grad_after_backward - sum(grads.values())
    if state.buckets or state.fsdp or rest < 0:
        grads = {s: 0 for s in stages}
        grads[min(stages)] = state.grad_after_backward
    elif rank.has_embedding and rank.has_head and last != 0:
        grads[0] += min(rest, 4 * counts.embedding)
        grads[last] += rest - min(rest, 4 * counts.embedding)
    else:
        grads[last if rank.has_head else min(stages)] += rest
    return grads


def _grad_note(zero: int, state: _State) -> str:
    if state.fsdp:
        return "fp32 1/dp shards (FSDP2)"
    if state.buckets and zero == 2:
        return "fp32 1/dp shard; full buckets only from the first gradient to their reduction"
    if state.buckets:
        return "fp32 buckets (persistent)" + (", reduce-scattered in place" if zero else "")
    return "fp32 p.grad, allocated in backward, freed after the step"


def _notes(lay: RankLayout, counts: ParamCounts) -> list[str]:
    m, t = lay.cfg.model, lay.cfg.train
    notes = []
    if is_cuda(lay.device) and lay.attention == "flash" and m.sliding_window:
        notes.append("sliding-window mask bytes are an estimate (efficient-attention kernel)")
    if lay.precision == "fp8":
        notes.append("fp8 is approximated (1-byte saved inputs, no weight copy in converted linears)")
    if t.compile is True:
        dm = _dims(m, lay.tokens, lay.batch, lay.precision, lay.tp, lay.sp)
        known = all(_compiled_save_set_known(lay.cfg, dm, lay.device, t.recompute, lay.attention,
                                             is_moe_layer(m, i), lay.precision == "fp8") for i in range(m.n_layers))
        notes.append("compiled blocks: the partitioner's save-set" + (" (train.recompute_casts: the lean one)"
                                                                        if t.recompute_casts is True else "")
                     if known else "torch.compile changes what is saved; these blocks are planned as eager")
    if not counts.exact:
        notes.append("parameters counted from the config, not the module")
    if not lay.update:
        notes.append("steps without an optimizer update: no optimizer state, no update temporaries")
    if lay.zero in (1, 2) and lay.dp > 1 and master_shards(lay.cfg, lay.precision):
        notes.append("ZeRO gathers bf16 parameters: the optimizer adds an fp32 master shard (4 bytes / dp per "
                     "parameter)")
    if lay.cfg.parallel.ep > 1 or lay.cp > 1:
        notes.append("expert parallelism: MoE activations assume balanced routing (an ep rank receives as many rows "
                     "as it sends)")
    return notes


def _setup(lay: RankLayout, rank: _RankModel, acts: _Activations, grad_note: str) -> dict:
    """What the plan was made for (the table's header and memory.json's "setup")."""
    m, t = lay.cfg.model, lay.cfg.train
    return {"preset": m.preset, "arch": m.arch, "precision": lay.precision, "recompute": t.recompute,
            "micro_batch_size": lay.batch, "seq_len": t.seq_len, "tokens_per_micro_batch": lay.tokens,
            "n_micro": lay.n_micro, "tp": lay.tp, "pp": lay.pp, "vpp": lay.vpp, "cp": lay.cp, "dp": lay.dp,
            "sp": lay.sp, "zero": lay.zero, "pp_rank": lay.pp_rank, "world_size": lay.world_size,
            "device": lay.device, "attention": lay.attention, "optimizer": t.optimizer,
            "params_local": rank.counts.local, "params_frozen": rank.counts.frozen, "grad_note": grad_note,
            "update": lay.update,
            "embedding_head_bytes": (acts.embedding if rank.has_embedding else 0)
            + (acts.head if rank.has_head else 0)}


def _fp8_linear_params(cfg: Config, tp: int, moe: bool, keep_attention: bool = False) -> int:
    """The linear weights of one block that fp8 converts: attention (unless kept bf16), and the dense MLP (MoE
    stays bf16)."""
    from megaloom.models.attention_shapes import attention_projections

    m = cfg.model
    _, ffn, _, _ = _resolved(m)
    d = m.d_model
    attn = 0 if keep_attention else sum(p.numel for p in attention_projections(m, tp))
    return attn + (0 if moe else (3 if _traits(m).gated_mlp else 2) * d * (ffn // tp))


def _step_transient(cfg: Config, device: str, p_opt: int, largest: int, tp: int, pp: int, dp: int,
                    buckets: bool, update: bool = True, zero: int = 0) -> int:
    from megaloom.parallel.data_parallel import STEP_GROUP_ELEMENTS

    t = cfg.train
    sharded = buckets and zero >= 1  # megaloom.optim.zero.ShardedOptimizer over the buckets' 1/dp chunks
    if not update:
        opt = 0
    elif t.optimizer_offload:  # the step runs on the host; a bf16 weight's upload lands in fp32 first, one at a time
        opt = 4 * largest if t.bf16_params is True else 0
    elif t.optimizer in ("lamb", "onebit_lamb"):
        opt = 4 * p_opt + 4 * largest  # every parameter's update u is kept until the trust ratios are known
        if t.optimizer == "onebit_lamb":
            opt += 4 * largest  # after the warm-up: a parameter's frozen and fresh denominators at once
    elif t.optimizer == "onebit_adam":
        opt = 4 * p_opt  # after the warm-up: every parameter's sqrt of the frozen variance (foreach)
    elif fused_optimizer(device):
        opt = 0  # fused AdamW (megaloom.optim, on CUDA): none
    elif sharded:  # foreach: sqrt(exp_avg_sq) of one parameter group, groups of STEP_GROUP_ELEMENTS + a segment
        opt = 4 * min(p_opt, STEP_GROUP_ELEMENTS + _largest_segment(cfg, largest, dp))
    else:
        opt = 4 * p_opt  # foreach: sqrt(exp_avg_sq) for all
    # p.grad.float().pow(2) per parameter; ZeRO's sharded norm is one _foreach_norm (no copy)
    clip = 4 * largest if (tp > 1 or pp > 1) and not sharded else 0
    sync = 4 * p_opt if (pp > 1 and dp > 1 and not buckets) else 0  # a flat all-reduce copy (no buckets)
    return max(opt, clip, sync)


def _with_precision(cfg: Config, precision: str) -> Config:
    import copy

    c = copy.deepcopy(cfg)
    c.train.precision = precision
    return c


class MemoryReport:
    """What `megaloom train` does with the plan (rank 0): print it at start-up and write ``run.dir/memory.json``;
    after the first logged step of the steady state (step >= 2: the optimizer state exists from the first
    update on) print the prediction next to the measured peak and add the measurement to memory.json."""

    def __init__(self, plan: MemoryPlan, path, device) -> None:
        from megaloom import accelerator

        self.plan, self.path, self.device = plan, path, device
        self.done = False
        on_device = accelerator.is_accelerator(device)
        self.setup_peak = accelerator.max_memory_allocated(device) if on_device else None  # before the first step

    @classmethod
    def start(cls, cfg: Config, model: nn.Module, *, world_size: int, device, pp_rank: int, n_micro: int,
              run_dir, enabled: bool = True) -> MemoryReport | None:
        """Plan, print and write; None (after a one-line warning) if the plan cannot be made: a report must
        never stop a run."""
        if not enabled:
            return None
        from pathlib import Path

        try:
            plan = plan_memory(cfg, model, world_size=world_size, device=device.type, pp_rank=pp_rank,
                               n_micro=n_micro)
        except Exception as e:  # a report must not stop the run
            log.warning(f"memory plan: not available ({type(e).__name__}: {e})")
            return None
        report = cls(plan, Path(run_dir) / "memory.json", device)
        log.info(plan.table())
        report.write()
        return report

    def write(self, extra: dict | None = None) -> None:
        d = self.plan.as_dict()
        d.update(extra or {})
        try:
            self.path.write_text(json.dumps(d, indent=1) + "\n")
        except OSError as e:
            log.warning(f"memory plan: could not write {self.path} ({e})")

    def after_step(self, step: int, total_steps: int) -> str | None:
        """Call after a logged step; reports once, at the first one with step >= 2 (or the last step)."""
        if self.done or (step < 2 and step < total_steps):
            return None
        from megaloom import accelerator
        from megaloom.observe.memory import peak_memory_gb

        self.done = True
        measured_gb = peak_memory_gb(self.device)
        predicted_gb = self.plan.peak / GB
        extra = {"measured_at_step": step}
        if accelerator.is_accelerator(self.device):
            self.plan.measured_peak = accelerator.max_memory_allocated(self.device)
            line = (f"memory: predicted peak {predicted_gb:.2f} GB, measured {measured_gb:.2f} GB "
                    f"({self.plan.error_pct():+.1f}%; predicted at the {self.plan.peak_phase})")
            if self.setup_peak is not None and self.plan.measured_peak <= self.setup_peak:
                line += "; note: the measured peak was reached during set-up, not training"
                extra["measured_peak_in_setup"] = True
        else:
            line = (f"memory: predicted peak {predicted_gb:.2f} GB, measured {measured_gb:.2f} GB (CPU: the "
                    "process's peak RSS, which also holds data, libraries and allocator caches; not compared)")
            extra["measured_rss_gb"] = measured_gb
        log.info(line)
        self.write(extra)
        return line

