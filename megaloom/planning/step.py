"""One training step of a layout on a cluster: compute, pipeline bubble, exposed communication, memory.

`predict(cfg, world, gpu)` plays the step as the code runs it:

- each virtual stage's forward and backward of one micro-batch (`compute.chunk_work`), plus the collectives that
  run inside it and are not hidden: compiled blocks issue their tensor-parallel collectives (sp: two all-gathers
  and two reduce-scatters of the [tokens, d_model] activations forward, as many backward; without sp two
  all-reduces each way) between their GEMMs with nothing to hide behind; expert parallelism's dispatch and combine
  all-to-alls likewise; ring attention's exchanges (cp) run under the attention kernel, only the excess shows;
- the pipeline: the schedule (parallel/pipeline/schedules.py) simulated with those times for its slowest stage
  and the point-to-point message time between stages (`checker.simulate`), whose makespan includes the bubble;
- data parallelism: the gradient reduction (an all-reduce, or ZeRO's reduce-scatter) starts during the last
  micro-batch's backward and only its excess over that backward shows; ZeRO's parameter all-gather overlaps the
  next step's first forward likewise; the optimizer runs at HBM bandwidth on what this rank updates;
- memory: `planning.memory_plan.plan_memory` of the first and the last pipeline stage (the stages with the most
  in-flight activations and with the head), the larger one reported.

``mode="dry-run"`` predicts `megaloom train --dry-run` on the fake process group instead: the same compute,
collectives free, no bubble (a fake receive never waits) - the quantity the H200 dry runs measured.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass, field

from megaloom.accelerator import CUDA, compute_precision
from megaloom.config import Config
from megaloom.models.attention_shapes import attention_projections, core_widths
from megaloom.models.registry import get_family
from megaloom.observe.flops import flops_per_token
from megaloom.parallel.data_parallel import param_gather_dtype
from megaloom.parallel.mesh import validate_layout
from megaloom.planning import comm
from megaloom.planning.compute import ChunkWork, chunk_work, optimizer_seconds
from megaloom.planning.hardware import GpuKind
from megaloom.planning.memory_activations import _resolved, is_moe_layer
from megaloom.planning.memory_params import analytic_params
from megaloom.planning.memory_plan import GB, plan_memory


@dataclass
class Prediction:
    world: int
    gpu: str
    sizes: dict[str, int]
    n_micro: int
    step_s: float
    tokens_per_s: float
    mfu: float
    compute_s: float  # the busiest rank's forwards and backwards (host-bound parts included)
    bubble_s: float  # pipeline idle time of that rank
    exposed: dict[str, float] = field(default_factory=dict)  # communication not hidden, by group, seconds a step
    optimizer_s: float = 0.0
    memory_gb: float = 0.0  # the worse of the first and last stage's planned peak
    memory_stage: int = 0
    memory_phase: str = ""
    fits: bool = True
    mode: str = "cluster"

    @property
    def exposed_s(self) -> float:
        return sum(self.exposed.values())


def _stage_works(cfg: Config, gpu: GpuKind) -> list[ChunkWork]:
    p = cfg.parallel
    if p.pp * p.vpp == 1:
        return [chunk_work(cfg, gpu, 0, range(cfg.model.n_layers), 0)]
    from megaloom.parallel.pipeline.partition import partition_layers

    part = partition_layers(cfg.model.n_layers, p.pp, p.vpp, p.pp_first_stage_layers or None,
                            p.pp_last_stage_layers or None)
    last = part.n_stages - 1
    return [chunk_work(cfg, gpu, s, part.layers(s), last) for s in range(part.n_stages)]


def tp_overlapped(cfg: Config) -> bool:
    """Whether a GPU run of ``cfg`` hides its sp collectives under the GEMMs: parallel.async_tp's compiled route
    (parallel/tp_overlap.py: CUDA with NCCL, compiled blocks), which auto takes; the eager ring is not modelled."""
    p = cfg.parallel
    return p.sp and p.tp > 1 and p.async_tp is not False and cfg.train.compile is not False


def _overlapped_tp(cfg: Config, act: float, link: comm.Link, w: ChunkWork, layers: list[int]
                   ) -> tuple[float, float]:
    """(forward, backward) exposed seconds of a chunk's sp collectives fused with their GEMMs by Inductor's
    micro-pipeline TP (``symm_mem.fused_all_gather_matmul`` / ``fused_matmul_reduce_scatter``): the tp - 1
    steps of a collective each run under 1/tp of the GEMMs that read (or produce) it, so each step shows only
    what its transfer takes beyond that GEMM chunk, ``max(0, c - g / tp)`` with ``c = alpha + B / tp / bw``; a
    reduce-scatter's last chunk waits for its GEMM and is exposed whole. Fused: per region, the gather with the
    GEMMs reading the region's input (q, k, v; gate, up) and the reduce-scatter with the GEMM before it (o;
    down); in backward, the gathers of the output gradients with o's and down's input-gradient GEMMs. Not fused
    (exposed whole, as the CPU test of the pattern matcher finds): the reduce-scatter of a region's input
    gradient (a sum of the q, k and v products) and an MoE layer's MLP region (the expert dispatch). The GEMMs'
    shares of a layer's GEMM time are their parameter shares."""
    m, tp = cfg.model, cfg.parallel.tp
    c = act / tp / link.bw + link.alpha  # one step of a ring collective over tp
    whole = comm.all_gather(act, tp, link)
    projections = attention_projections(m, tp)
    attn_in = sum(pr.out * pr.inp for pr in projections[:-1])
    attn_out = projections[-1].out * projections[-1].inp
    ffn = _resolved(m)[1]
    gated = get_family(m.arch).traits.gated_mlp
    mlp_in, mlp_out = (2 if gated else 1) * m.d_model * ffn // tp, m.d_model * ffn // tp
    fwd = bwd = 0.0
    n = max(1, len(layers))
    for layer in layers:
        moe = is_moe_layer(m, layer)
        total = attn_in + attn_out + (0 if moe else mlp_in + mlp_out)
        g_f, g_b = w.forward.gemm / n, w.backward.gemm / n  # this layer's GEMM seconds

        def hidden(share: float, g: float, total: float = total) -> float:  # exposed under GEMMs of that share
            return (tp - 1) * max(0.0, c - share / total * g / tp)

        # forward: the attention's gather under q/k/v and its reduce-scatter under o (+ its last chunk)
        fwd += hidden(attn_in, g_f) + hidden(attn_out, g_f) + c
        # backward: the output gradient's gather under o's input-gradient GEMM (half of o's backward), the input
        # gradient's reduce-scatter whole
        bwd += hidden(attn_out, g_b / 2) + whole
        if moe:
            fwd, bwd = fwd + 2 * whole, bwd + 2 * whole
        else:
            fwd += hidden(mlp_in, g_f) + hidden(mlp_out, g_f) + c
            bwd += hidden(mlp_out, g_b / 2) + whole
    return fwd, bwd


def _inside_stage_comm(cfg: Config, gpu: GpuKind, sizes: dict[str, int], w: ChunkWork, layers: list[int]
                       ) -> tuple[dict[str, float], dict[str, float]]:
    """(forward, backward) seconds of the collectives a stage's micro-batch waits for, by group."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    tokens = t.micro_batch_size * t.seq_len // p.cp
    act = tokens * m.d_model * 2  # bf16 [tokens, d_model]
    fwd: dict[str, float] = {}
    bwd: dict[str, float] = {}
    n_layers = len(layers)
    if p.tp > 1:
        link = comm.link_of(gpu, sizes, "tp")
        if p.sp and tp_overlapped(cfg):
            fwd["tp"], bwd["tp"] = _overlapped_tp(cfg, act, link, w, layers)
        else:
            one = (comm.all_gather(act, p.tp, link) + comm.reduce_scatter(act, p.tp, link) if p.sp
                   else comm.all_reduce(act, p.tp, link))
            fwd["tp"] = bwd["tp"] = 2 * one * n_layers
    if p.cp > 1:  # ring attention: cp - 1 exchanges of this rank's k, v (backward: also dk, dv), under attention
        _, k_width, v_width = core_widths(m, p.tp)
        kv_bytes = tokens * (k_width + v_width) * 2
        link = comm.link_of(gpu, sizes, "cp")
        ring = (p.cp - 1) * comm.p2p(kv_bytes, link)
        attn_f = w.forward.attention / max(1, n_layers)
        attn_b = w.backward.attention / max(1, n_layers)
        fwd["cp"] = max(0.0, ring - attn_f) * n_layers
        bwd["cp"] = max(0.0, 2 * ring - attn_b) * n_layers
    if p.ep > 1:
        moe = sum(1 for i in layers if is_moe_layer(m, i))
        link = comm.link_of(gpu, sizes, "dp", size=p.ep)
        a2a = comm.all_to_all(tokens * m.top_k * m.d_model * 2, p.ep, link)
        fwd["ep"] = bwd["ep"] = 2 * a2a * moe
    return fwd, bwd


def _updated_params(cfg: Config, sizes: dict[str, int], pp_rank: int) -> tuple[int, int]:
    """(this rank's parameters, the ones it updates: 1/dp of them with ZeRO)."""
    p = cfg.parallel
    if p.pp > 1:
        from megaloom.parallel.pipeline.partition import partition_layers

        part = partition_layers(cfg.model.n_layers, p.pp, p.vpp, p.pp_first_stage_layers or None,
                                p.pp_last_stage_layers or None)
        stages = part.stages_of_rank(pp_rank)
        layers = [i for s in stages for i in part.layers(s)]
        first, last = 0 in stages, part.n_stages - 1 in stages
    else:
        layers, first, last = list(range(cfg.model.n_layers)), True, True
    counts = analytic_params(cfg, layers, first, last, p.tp, p.ep)
    local = counts.local
    shard = local // (sizes["dp"] * p.cp) if p.zero >= 1 else local
    return local, shard


def _rank_layers(cfg: Config, pp_rank: int) -> list[int]:
    """The blocks pipeline rank ``pp_rank`` holds (all of them without a pipeline)."""
    p = cfg.parallel
    if p.pp == 1:
        return list(range(cfg.model.n_layers))
    from megaloom.parallel.pipeline.partition import partition_layers

    part = partition_layers(cfg.model.n_layers, p.pp, p.vpp, p.pp_first_stage_layers or None,
                            p.pp_last_stage_layers or None)
    return [i for s in part.stages_of_rank(pp_rank) for i in part.layers(s)]


def muon_matrices(cfg: Config, layers: list[int]) -> list[comm.MuonMatrix]:
    """The matrices Muon updates in ``layers`` (megaloom/optim/muon.py's `is_muon_param`: the blocks' 2-D weights
    and expert stacks), tp-local and whole, in the order of the model's parameters."""
    m, tp, ep = cfg.model, cfg.parallel.tp, cfg.parallel.ep
    _, ffn, fe, _ = _resolved(m)
    gated = get_family(m.arch).traits.gated_mlp
    out = []
    for i in layers:
        for loc, whole in zip(attention_projections(m, tp), attention_projections(m, 1), strict=True):
            split = loc.split != "replicated"
            out.append(comm.MuonMatrix(loc.out * loc.inp, whole.out, whole.inp, tp_split=split))
        if is_moe_layer(m, i):
            out.append(comm.MuonMatrix(m.n_experts * m.d_model, m.n_experts, m.d_model, tp_split=False))
            e = m.n_experts // ep
            out += [comm.MuonMatrix(e * fe // tp * m.d_model, fe, m.d_model, e, expert=True) for _ in range(3)]
            if m.n_shared_experts:
                sf = m.n_shared_experts * fe
                out += [comm.MuonMatrix(sf // tp * m.d_model, sf, m.d_model) for _ in range(3)]
        else:
            out += [comm.MuonMatrix(ffn // tp * m.d_model, ffn, m.d_model) for _ in range(3 if gated else 2)]
    return out


def _muon_seconds(cfg: Config, gpu: GpuKind, sizes: dict[str, int], pp_rank: int) -> tuple[float, float]:
    """(exchange, Newton-Schulz) seconds of pipeline rank ``pp_rank``'s Muon step (planning/comm.py)."""
    p = cfg.parallel
    dp = sizes["dp"]
    tp_link = comm.link_of(gpu, sizes, "tp")
    dp_link = comm.link_of(gpu, sizes, "dp")
    edp_link = comm.link_of(gpu, sizes, "dp", size=max(1, dp // p.ep))
    return comm.muon_exchange(muon_matrices(cfg, _rank_layers(cfg, pp_rank)), p.tp, dp, p.ep, p.zero, tp_link,
                              dp_link, edp_link, gpu.peak_tflops * 1e12)


@functools.lru_cache(maxsize=4096)
def _makespan(schedule: str, pp: int, vpp: int, n_micro: int, b_over_f: float, comm_over_f: float) -> float:
    """The simulated schedule's makespan in units of one forward (times scale with the forward when the ratios
    are fixed: a search of many layouts sharing a pipeline shape simulates it once)."""
    from megaloom.parallel.pipeline.checker import simulate
    from megaloom.parallel.pipeline.schedules import build_schedule

    b = b_over_f
    costs = {"F": 1.0, "B": b, "BI": b / 2, "BW": b / 2, "COMM": comm_over_f}
    if n_micro <= 3 * pp:
        return simulate(build_schedule(schedule, pp, vpp, n_micro), costs).makespan
    # Past the warm-up the schedule repeats: every pp more micro-batches add the same time. Two short simulations
    # give that slope (checked against the full simulation in tests/planning).
    m0, m1 = 2 * pp, 3 * pp
    t0 = simulate(build_schedule(schedule, pp, vpp, m0), costs).makespan
    t1 = simulate(build_schedule(schedule, pp, vpp, m1), costs).makespan
    return t1 + (t1 - t0) * (n_micro - m1) / pp


def predict(cfg: Config, world: int, gpu: GpuKind, mode: str = "cluster", memory: bool = True,
            pp_rank: int | None = None) -> Prediction:
    """The step of ``cfg``'s layout at ``world`` GPUs of kind ``gpu`` (module doc). ``cfg`` must be resolved
    (model.vocab_size set: planning.memory_fit.resolve_for_planning). ``pp_rank``: the pipeline rank whose step a
    dry run measures (default: the busiest)."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    sizes = validate_layout(cfg, world)
    dp = sizes["dp"]
    if t.recompute_casts == "auto":  # as `megaloom train` decides it: on only where the plan does not fit without
        from megaloom.planning.memory_fit import choose_recompute_casts

        cfg = copy.deepcopy(cfg)
        cfg.train.recompute_casts = choose_recompute_casts(cfg, world, 0.95 * gpu.memory_gb)[0]
        m, p, t = cfg.model, cfg.parallel, cfg.train
    n_micro = max(1, t.global_batch_size // (dp * t.micro_batch_size))
    works = _stage_works(cfg, gpu)
    dry = mode == "dry-run"
    if p.pp > 1:
        from megaloom.parallel.pipeline.partition import partition_layers

        part = partition_layers(m.n_layers, p.pp, p.vpp, p.pp_first_stage_layers or None,
                                p.pp_last_stage_layers or None)
        stage_layers = [list(part.layers(s)) for s in range(part.n_stages)]
    else:
        stage_layers = [list(range(m.n_layers))]
    f_times, b_times, exposed = [], [], {}
    for w, layers in zip(works, stage_layers, strict=True):
        cf, cb = ({}, {}) if dry else _inside_stage_comm(cfg, gpu, sizes, w, layers)
        f_times.append(w.seconds(gpu, "F", dry) + sum(cf.values()))
        b_times.append(w.seconds(gpu, "B", dry) + sum(cb.values()))
        for k in set(cf) | set(cb):
            exposed[k] = max(exposed.get(k, 0.0), (cf.get(k, 0.0) + cb.get(k, 0.0)) * n_micro * p.vpp)
    # the busiest pipeline rank: its chunks' forwards and backwards of every micro-batch
    per_rank = [sum(f_times[s] + b_times[s] for s in range(r, len(works), p.pp)) * n_micro for r in range(p.pp)]
    busiest = max(range(p.pp), key=lambda r: per_rank[r]) if pp_rank is None else pp_rank
    compute = per_rank[busiest]
    if p.pp > 1 and not dry:
        whole = t.micro_batch_size * t.seq_len // p.cp * m.d_model * 2
        # sp's messages are sequence-shards; without sp, scatter/gather sends a 1/tp piece and the receiving
        # stage all-gathers it over tp before use (parallel/pipeline/executor.py)
        scatter = p.tp > 1 and not p.sp and p.pp_scatter_gather
        pp_msg = whole // (p.tp if p.sp or scatter else 1)
        p2p = comm.p2p(pp_msg, comm.link_of(gpu, sizes, "pp"))
        if scatter:
            p2p += comm.all_gather(whole, p.tp, comm.link_of(gpu, sizes, "tp"))
        f, b = max(f_times), max(b_times)
        pipe = f * _makespan(p.schedule, p.pp, p.vpp, n_micro, round(b / f, 1), round(p2p / f, 2))
        exposed["pp"] = p2p * 2 * n_micro * p.vpp  # (its messages also stretch the makespan above)
        bubble = max(0.0, pipe - max(per_rank) / 1.0)
    else:
        pipe, bubble = compute, 0.0
    local, updated = _updated_params(cfg, sizes, busiest)
    opt = optimizer_seconds(gpu, updated)
    if not dry and dp * p.cp > 1:
        exposed["dp"] = _dp_exposed(cfg, gpu, sizes, local, f_times[busiest], b_times[busiest], n_micro)
    if t.optimizer == "muon":  # its exchange blocks the step: exposed whole; Newton-Schulz joins the optimizer
        muon_comm, ns = _muon_seconds(cfg, gpu, sizes, busiest)
        exposed["muon"], opt = (0.0 if dry else muon_comm), opt + ns
    step = pipe + exposed.get("dp", 0.0) + exposed.get("muon", 0.0) + opt
    tokens = t.global_batch_size * t.seq_len
    fpt = flops_per_token(m, _active_matmul_params(cfg), t.seq_len)
    pred = Prediction(world=world, gpu=gpu.name, sizes=sizes, n_micro=n_micro, step_s=step,
                      tokens_per_s=tokens / step, mfu=fpt * tokens / (world * step * gpu.peak_tflops * 1e12),
                      compute_s=compute, bubble_s=bubble, exposed={k: v for k, v in exposed.items() if v > 0},
                      optimizer_s=opt, mode=mode)
    if memory:
        _add_memory(pred, cfg, world, gpu)
    return pred


def _dp_exposed(cfg: Config, gpu: GpuKind, sizes: dict[str, int], local: int, forward: float, backward: float,
                n_micro: int) -> float:
    """The data-parallel exchange of one step (over dp, or dp x cp) that the busiest rank's compute does not hide:
    ``local`` its updated parameters, ``forward`` / ``backward`` one micro-batch's chunk times on that rank."""
    p, t = cfg.parallel, cfg.train
    dp = sizes["dp"]
    link = comm.link_of(gpu, sizes, "dp", size=dp) if p.cp == 1 else comm.link_of(gpu, sizes, "cp", size=dp * p.cp)
    n = dp * p.cp
    last_backward = backward * p.vpp
    first_forward = forward
    plain = max(0.0, comm.all_reduce(4 * local, n, link) - last_backward)  # zero 0: under the last backward
    if p.zero == 0 and t.optimizer.startswith("onebit_"):  # the step after the warm-up: not overlapped
        refreshed = comm.refreshed_fraction(t.onebit_warmup_steps, t.steps, t.onebit_variance_updates)
        return (1 - refreshed) * comm.onebit_exchange(local, n, link, gpu.hbm_tbps * 1e12) + refreshed * plain
    if p.zero == 0:
        return plain
    if p.zero in (1, 2):
        gather_bytes = param_gather_dtype(cfg.parallel.param_gather, compute_precision(cfg, CUDA)).itemsize
        reduce = comm.reduce_scatter(4 * local, n, link)
        gather = comm.all_gather(gather_bytes * local, n, link)
        return max(0.0, reduce - last_backward) + max(0.0, gather - first_forward)
    # zero 3 (FSDP2): every micro-batch gathers the weights twice and reduce-scatters the gradients
    per_mb = 2 * comm.all_gather(2 * local, n, link) + comm.reduce_scatter(4 * local, n, link)
    return max(0.0, per_mb - (forward + backward) * p.vpp) * n_micro


def _active_matmul_params(cfg: Config) -> int:
    """The whole model's matmul parameters a token goes through (the MFU's numerator): routed experts count
    top_k / n_experts of their weights (observe/flops.py)."""
    m = cfg.model
    full = analytic_params(cfg, list(range(m.n_layers)), True, True, 1, 1)
    mm = sum(full.matmul_layers.values()) + full.matmul_head
    if m.moe_every:
        _, _, fe, _ = _resolved(m)
        routed = sum(3 * m.n_experts * m.d_model * fe for i in range(m.n_layers) if is_moe_layer(m, i))
        mm -= int(routed * (1 - m.top_k / m.n_experts))
    return mm


def _add_memory(pred: Prediction, cfg: Config, world: int, gpu: GpuKind) -> None:
    plans = [(r, plan_memory(cfg, world_size=world, device=CUDA, pp_rank=r, n_micro=pred.n_micro))
             for r in sorted({0, cfg.parallel.pp - 1})]
    stage, plan = max(plans, key=lambda rp: rp[1].peak)
    pred.memory_gb, pred.memory_stage, pred.memory_phase = plan.peak / GB, stage, plan.peak_phase
    pred.fits = plan.peak <= 0.95 * gpu.memory_gb * GB


def with_layout(cfg: Config, **changes) -> Config:
    """A copy of ``cfg`` with parallel.* / train.* keys replaced (``tp=8``, ``micro_batch_size=2`` ...)."""
    out = copy.deepcopy(cfg)
    for key, value in changes.items():
        section = out.parallel if hasattr(out.parallel, key) else out.train
        setattr(section, key, value)
    return out
