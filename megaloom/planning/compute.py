"""One rank's compute for one micro-batch, chunk by chunk, from the kernels its blocks run.

The inventory is the one the dry run executes (compiled pre-norm decoder blocks under tp/sp, cp and ep), counted
from the config alone:

- GEMMs: each linear of a block on this rank's shard, forward (M = tokens, N = local output width, K = input width)
  and backward (the input gradient and the weight gradient: two more of the same FLOPs); a recomputed block runs
  its forward again in backward. Each GEMM at the calibrated rate for its smallest dimension
  (`GpuKind.gemm_tflops`). MoE experts: the rows routed to this rank's experts (balanced routing), top_k per token.
- attention: the causal score and value FLOPs of this rank's heads and tokens (cp: 1/cp of the pairs), at the
  calibrated rate for the sequence length and head size, 1/3.5 of it in forward and 2.5/3.5 in backward (the
  convention the calibration's rates are counted in).
- everything else on the GPU (norms, RoPE, SwiGLU, residual adds, weight and gradient casts, the data-parallel
  bucket adds, copies): memory-bound kernels, modelled as bytes at the calibrated HBM bandwidth. Their count is
  not derived kernel by kernel: ``ACT_BYTES`` per byte of the block's main activations and ``WEIGHT_BYTES`` per
  local weight were fitted to the H200 dry runs of 2026-12-04 (docs/planner.md lists them and the residuals),
  ``HEAD_BYTES`` per local logit of the vocabulary-parallel loss to the last stage's rank of one of them.
- the host: a kernel launch costs the host ``GpuKind.launch_us`` (calibrated as every host cost per kernel of a
  compiled block, Python included); a chunk's time is the larger of its GPU time and its host time (the host runs
  ahead of the GPU when it can, and the GPU waits for it when it cannot).

The optimizer is apart (`optimizer_seconds`): AdamW moves ~32 bytes per parameter it updates.
"""

from __future__ import annotations

from dataclasses import dataclass

from megaloom.config import Config
from megaloom.models.attention_shapes import attention_projections, core_head_dim, core_widths, qk_head_dim, v_head_dim
from megaloom.planning.hardware import GpuKind
from megaloom.planning.memory_activations import _resolved, is_moe_layer

ACT_BYTES = 10.9  # bytes moved per byte of a block's main activations (fitted, module doc)
# The weights' memory-bound traffic per local weight per micro-batch (casts, gradient casts, bucket adds), refitted
# 2026-12-06 to the H100 dry runs of the llama3-70b tp8 pp8 vpp2 rank (4k and 8k; elementwise + copy kernels less
# the fake group's copies, less ACT_BYTES x the activations, at the h100 file's 3.0 TB/s): fusion off and fp32
# weights 27.6 bytes (86c7f87), the fusion on 9.3 (e161373), the fusion and bf16 weights 1.5 at 4k and 0.8 at 8k
# (c58b457). (The H200 fit of 2026-12-04, 42.6 bytes, measured the code of that day: its bucket adds and casts.)
WEIGHT_BYTES = 27.6  # fusion off, fp32 weights: autocast's weight casts, the bf16 gradient's fp32 copy and the add
FUSED_SAVING = 18.3  # what train.grad_accum_fusion removes: the gradient's fp32 copy and the bucket hook's add
CAST_SAVING = 8.1  # what train.bf16_params removes besides: the weights' casts to bf16 (1.2 bytes a weight remain)
MOE_WEIGHT_BYTES = 42.6  # an MoE layer's (experts unfused, their grouped GEMMs' casts): the 2026-12-04 fit, which the
#                         H100 mixtral-8x7b ep8 and deepseek-v3 ep64 ranks of 2026-12-06 still match (-4.3%, +0.4%)
FAKE_COPY_BYTES = 15.0  # per token x d_model element and block: the dry run's fake-group copies of sp's 4 all-gathers
#                        (each writes and reads the gathered bf16 [tokens, d]: 16 by count; fitted 15.0 from the H100
#                        70B 4k rank's 26.96 ms, 2026-12-06 07:10 trace); a real group's NCCL kernels replace them
HEAD_BYTES = 300.0  # bytes moved per local logit by the vocabulary-parallel loss, forward and backward (fitted)
EMBEDDING_BYTES = 16.0  # per local embedding element: the dense gradient's fill and scatter, per micro-batch
KERNELS_PER_BLOCK = 70  # kernels of one compiled dense block, forward + backward (the H200 dry runs: 70-78)
FUSED_KERNELS = 14  # of those, what the fused weight gradients remove (H100 70B 4k rank: 11,374 -> 9,134 kernels over
#                     160 block passes)
CAST_KERNELS = 8  # and what bf16 weights remove (the same rank: 9,134 -> 7,816 kernels)
RING_KERNELS = 35  # more with context parallelism: ring attention runs eagerly between the block's graphs (105)
BACKWARD_SHARE = 2.0 / 3.0  # of a block's memory-bound work, the share that runs in backward
ATTENTION_FORWARD = 1.0 / 3.5  # of fused attention's time, the forward's share (FLOPs 1 : 2.5)
OPTIMIZER_BYTES = 32.0  # AdamW per updated parameter: weight, gradient, two moments read and written


@dataclass(frozen=True)
class Work:
    """Seconds of one micro-batch's forward or backward on one chunk, by kind, and its kernel count."""

    gemm: float = 0.0
    attention: float = 0.0
    memory: float = 0.0  # memory-bound kernels
    kernels: int = 0
    fake: float = 0.0  # a dry run's fake-group copies (sp's gathers): counted by mode="dry-run" only

    @property
    def gpu(self) -> float:
        return self.gemm + self.attention + self.memory

    def __add__(self, o: Work) -> Work:
        return Work(self.gemm + o.gemm, self.attention + o.attention, self.memory + o.memory,
                    self.kernels + o.kernels, self.fake + o.fake)


@dataclass(frozen=True)
class ChunkWork:
    """One virtual stage of this rank, one micro-batch: forward and backward work, and the FLOPs the model
    counts for them (6 x matmul parameters x tokens + attention, as observe/flops.py)."""

    stage: int
    layers: int
    forward: Work
    backward: Work
    model_flops: float

    def seconds(self, gpu: GpuKind, part: str, dry: bool = False) -> float:
        """GPU time, or the host's if longer (module doc); ``dry``: with the fake group's copies (a dry run)."""
        w = self.forward if part == "F" else self.backward
        return max(w.gpu + (w.fake if dry else 0.0), w.kernels * gpu.launch_us * 1e-6)


def _gemm(gpu: GpuKind, m: int, n: int, k: int, recompute: bool) -> tuple[float, float]:
    """(forward, backward) seconds of one linear: y[m, n] = x[m, k] W^T."""
    f = gpu.gemm_seconds(m, n, k)
    b = gpu.gemm_seconds(m, k, n) + gpu.gemm_seconds(n, k, m) + (f if recompute else 0.0)
    return f, b


def block_work(cfg: Config, gpu: GpuKind, layer: int, tokens: int, recompute: bool) -> tuple[Work, Work, float]:
    """(forward, backward, model FLOPs) of block ``layer`` for ``tokens`` tokens on this rank (micro-batch x
    seq_len / cp), on its tp shard."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    tp, cp = p.tp, p.cp
    _, ffn, fe, _ = _resolved(m)
    d = m.d_model
    hl = m.n_heads // tp
    sp = p.sp and tp > 1
    n, n_r = tokens, tokens // tp if sp else tokens
    linears = [(pr.out, pr.inp) for pr in attention_projections(m, tp)]  # (out, in): q, k, v, o (or MLA's)
    params = sum(o * i for o, i in linears)
    moe = is_moe_layer(m, layer)
    if moe:  # balanced routing: this rank's experts see top_k rows per token of its ep group's share
        e_local = m.n_experts // p.ep
        rows = max(1, n * m.top_k // max(1, e_local))
        expert = [(fe // tp, d), (fe // tp, d), (d, fe // tp)]
        fs = m.n_shared_experts * fe // tp
        shared = [(fs, d), (fs, d), (d, fs)] if m.n_shared_experts else []
        params += e_local * sum(o * i for o, i in expert) + sum(o * i for o, i in shared) + m.n_experts * d
        width = fe // tp
    else:
        mlp = [(ffn // tp, d), (ffn // tp, d), (d, ffn // tp)]
        linears += mlp
        params += sum(o * i for o, i in mlp)
        width = ffn // tp
    fwd = bwd = 0.0
    for o, i in linears:
        f, b = _gemm(gpu, n, o, i, recompute)
        fwd, bwd = fwd + f, bwd + b
    mm_flops = 2.0 * n * sum(o * i for o, i in linears)
    if moe:
        for o, i in expert:
            f, b = _gemm(gpu, rows, o, i, recompute)
            fwd, bwd = fwd + f * e_local, bwd + b * e_local
        for o, i in shared:
            f, b = _gemm(gpu, n, o, i, recompute)
            fwd, bwd = fwd + f, bwd + b
        mm_flops += 2.0 * n * m.top_k * sum(o * i for o, i in expert) + 2.0 * n * sum(o * i for o, i in shared)
    # Causal attention of this rank's heads: its tokens' queries against the sequence (cp: 1/cp of the pairs).
    # QK^T and PV, half the pairs, x2 FLOPs: (q/k head + v head) / 2 is head_dim for grouped-query attention
    attn_fwd_flops = 2.0 * (tokens * cp) * t.seq_len * hl * (qk_head_dim(m) + v_head_dim(m)) / 2 / cp
    attn = 3.5 * attn_fwd_flops / (gpu.attention_tflops(t.seq_len, core_head_dim(m)) * 1e12)
    act = n_r * d * 4 + n * width * 2 + n * sum(core_widths(m, tp)) * 2 + n * d * 2
    weight_bytes = ((MOE_WEIGHT_BYTES if moe else WEIGHT_BYTES)
                    - (FUSED_SAVING if t.grad_accum_fusion is True and not moe else 0.0)
                    - (CAST_SAVING if t.bf16_params is True else 0.0))
    memory = gpu.memory_seconds(ACT_BYTES * act + weight_bytes * params)
    kernels = (KERNELS_PER_BLOCK + (RING_KERNELS if cp > 1 else 0)
               - (FUSED_KERNELS if t.grad_accum_fusion is True and not moe else 0)
               - (CAST_KERNELS if t.bf16_params is True else 0))
    # the dry run's fake group fills every chunk of sp's all-gathers with copies (2 forward, 2 backward per block)
    fake = gpu.memory_seconds(FAKE_COPY_BYTES * n * d) if sp else 0.0
    forward = Work(fwd, attn * ATTENTION_FORWARD, memory * (1 - BACKWARD_SHARE), kernels // 3, fake / 2)
    backward = Work(bwd, attn * (1 - ATTENTION_FORWARD), memory * BACKWARD_SHARE, kernels - kernels // 3, fake / 2)
    # model FLOPs (MFU's count): 3 passes of the matmuls + the full (not causal-halved) attention, as flops.py
    model = 3.0 * mm_flops + 3.0 * 2.0 * attn_fwd_flops
    return forward, backward, model


def chunk_work(cfg: Config, gpu: GpuKind, stage: int, layers: range | list[int], last_stage: int) -> ChunkWork:
    """One micro-batch through virtual stage ``stage`` (its blocks, plus the embedding on stage 0 and the head
    and loss on the last)."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    tokens = t.micro_batch_size * t.seq_len // p.cp
    full = t.recompute == "full"
    per_stage = t.recompute_layers or len(layers)
    fwd, bwd, flops = Work(), Work(), 0.0
    seen: dict[tuple[bool, bool], tuple[Work, Work, float]] = {}  # dense blocks are alike: one per kind
    for j, i in enumerate(layers):
        key = (is_moe_layer(m, i), full and j < per_stage)
        if key not in seen:
            seen[key] = block_work(cfg, gpu, i, tokens, key[1])
        f, b, fl = seen[key]
        fwd, bwd, flops = fwd + f, bwd + b, flops + fl
    tp = p.tp
    vocab_local = m.vocab_size // tp
    if stage == 0:  # the embedding's backward: a dense gradient of the local rows
        bwd = bwd + Work(memory=gpu.memory_seconds(EMBEDDING_BYTES * vocab_local * m.d_model), kernels=4)
    if stage == last_stage:  # head GEMM (+ its backward) and the loss
        f, b = _gemm(gpu, tokens, vocab_local, m.d_model, False)
        loss = gpu.memory_seconds(HEAD_BYTES * tokens * vocab_local)
        fwd = fwd + Work(gemm=f, memory=loss / 3, kernels=10)
        bwd = bwd + Work(gemm=b, memory=2 * loss / 3, kernels=20)
        flops += 6.0 * tokens * vocab_local * m.d_model
    return ChunkWork(stage, len(layers), fwd, bwd, flops)


def rank_chunks(cfg: Config, gpu: GpuKind, pp_rank: int) -> list[ChunkWork]:
    """This rank's virtual stages (one without a pipeline), each for one micro-batch."""
    p = cfg.parallel
    if p.pp > 1:
        from megaloom.parallel.pipeline.partition import partition_layers

        part = partition_layers(cfg.model.n_layers, p.pp, p.vpp, p.pp_first_stage_layers or None,
                                p.pp_last_stage_layers or None)
        last = part.n_stages - 1
        return [chunk_work(cfg, gpu, s, part.layers(s), last) for s in part.stages_of_rank(pp_rank)]
    return [chunk_work(cfg, gpu, 0, range(cfg.model.n_layers), 0)]


def optimizer_seconds(gpu: GpuKind, updated_params: int) -> float:
    return gpu.memory_seconds(OPTIMIZER_BYTES * updated_params)
