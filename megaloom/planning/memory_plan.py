"""The memory report: predicted bytes per rank for weights, gradients, optimizer state and activations.

`plan_memory(cfg, model)` is called at start-up, after the model is built, parallelised and (with pipelines)
cut into this rank's stage; it counts this rank's parameters exactly from the module and everything else
from the config. No forward pass is run. The trainer prints `MemoryPlan.table()` and, after the first
steps, the prediction next to the device allocator's peak (`accelerator.max_memory_allocated`).

Persistent state (megaloom keeps fp32 parameters and runs bf16/fp16 under autocast):

  weights      4 bytes x this rank's parameters (ZeRO-3: its 1/dp shard)
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
copy of the state, or with ZeRO of one parameter group of megaloom.parallel.zero.STEP_GROUP_ELEMENTS; LAMB: the
update of every parameter). The predicted peak is the largest event; which one
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

import dataclasses
import functools
import json
import math
from dataclasses import asdict, dataclass, field, replace

from torch import nn

from megaloom.accelerator import CUDA, fused_optimizer, is_accelerator, is_cuda
from megaloom.config import Config, ModelConfig, resolved_head_dim
from megaloom.observe.log import get_logger
from megaloom.parallel.layout import layout_of
from megaloom.planning.levers import compute_precision, resolve_levers
from megaloom.planning.memory_mla import is_mla, mla_attention_bytes

log = get_logger(__name__)
GB = 1e9  # the report's unit, as megaloom.observe.memory.peak_memory_gb
_ATTN_NAMES = {"flash": "flash/cuDNN", "efficient": "mem-efficient", "math": "math"}
# cuBLAS takes its workspace from PyTorch's allocator, 32 MiB per thread that runs matmuls (Hopper; measured on
# an H200, torch 2.11): the training thread and autograd's backward thread.
CUBLAS_WORKSPACE = 2 * 32 * 2**20
PHASES = ("forward", "loss forward", "loss backward", "head backward", "backward", "recompute", "optimizer step")


def _traits(m: ModelConfig):
    """The family's `megaloom.models.family.Traits`: what the plan asks instead of testing ``model.arch``."""
    from megaloom.models.registry import get_family

    return get_family(m.arch).traits


def _resolved(m: ModelConfig) -> tuple[int, int, int, int]:
    """(n_kv_heads, ffn_dim, expert_ffn_dim, head_dim) with the "auto" zeros filled in."""
    from megaloom.models.transformer import resolved_ffn_dim

    kv = m.n_kv_heads or m.n_heads
    ffn = resolved_ffn_dim(m)
    return kv, ffn, m.expert_ffn_dim or ffn, resolved_head_dim(m)


def is_moe_layer(m: ModelConfig, index: int) -> bool:
    from megaloom.models.moe import is_moe_block

    return is_moe_block(m, index)


def attention_backend(cfg: Config, device: str, tp: int = 1) -> str:
    """Which SDPA save-set applies: "flash" (flash or cuDNN on GPU in bf16/fp16; the CPU flash kernel),
    "efficient" (GPU fp32 without grouped-query heads) or "math" (GPU fp32 with grouped-query heads, which
    the fused kernels do not take in fp32; train.attention=math; CPU with dropout)."""
    m = cfg.model
    if is_cuda(device):
        if cfg.train.attention == "math":
            return "math"
        if compute_precision(cfg, device) == "fp32":
            kv = m.n_kv_heads or m.n_heads
            return "efficient" if m.n_heads // tp == max(kv // tp, 1) else "math"
        return "flash"
    return "math" if m.dropout > 0 else "flash"  # CPU's flash kernel has no dropout


# ----------------------------------------------------------------------------------------- activations


@dataclass(frozen=True)
class _Dims:
    """Everything the activation enumeration needs, local to one rank."""

    n: int  # tokens per micro-batch entering the tensor-parallel regions (full sequence / cp)
    n_r: int  # tokens in the residual stream (n / tp with sequence parallelism)
    b: int  # sequences per micro-batch
    t: int  # tokens per sequence on this rank
    d: int
    hl: int  # query heads on this rank
    hkvl: int  # kv heads on this rank (replicated when tp > n_kv_heads)
    hd: int
    fl: int  # dense MLP hidden size on this rank
    a: int  # bytes per element of activations in the compute dtype
    autocast: bool
    tp: int
    sp: bool


def _dims(cfg: ModelConfig, tokens: int, batch: int, precision: str, tp: int, sp: bool) -> _Dims:
    kv, ffn, _, hd = _resolved(cfg)
    autocast = precision != "fp32"
    return _Dims(n=tokens, n_r=tokens // tp if (sp and tp > 1) else tokens, b=batch, t=tokens // batch,
                 d=cfg.d_model, hl=cfg.n_heads // tp, hkvl=max(kv // tp, 1), hd=hd, fl=ffn // tp,
                 a=2 if autocast else 4, autocast=autocast, tp=tp, sp=sp and tp > 1)


def _norm_bytes(norm: str, n: int, d: int, device: str) -> int:
    """Saved by one norm of kind ``norm`` (Traits.norm) over an fp32 [n, d] input."""
    if norm == "layernorm":
        return 4 * n * d + 8 * n  # native_layer_norm: input, mean, rstd
    if norm != "rmsnorm":
        raise ValueError(f"memory plan: no save-set known for norm {norm!r} (layernorm, rmsnorm)")
    if is_cuda(device):
        return 4 * n * d + 4 * n  # fused RMSNorm: input, rstd
    return 8 * n * d + 4 * n  # composite RMSNorm (CPU): input, rsqrt, x * rsqrt


def _qk_norm_bytes(rows: int, hd: int, device: str, autocast: bool) -> int:
    """Saved by the per-head q and k RMSNorms (Traits.qk_norm) over ``rows`` = tokens x (q + kv heads) of ``hd``.
    Their input is the projection's output in the compute dtype, their weight fp32 (measured: torch 2.13 on CPU,
    2.11 on an H200). A bf16 input with the fp32 weight cannot take the fused kernel, on CPU or CUDA: the
    composite runs in fp32 and keeps the input's fp32 upcast, rsqrt and x * rsqrt; so does fp32 on CPU (its input
    is the projection's output itself). fp32 on CUDA: the fused kernel, input and rstd."""
    if is_cuda(device) and not autocast:
        return 4 * rows * hd + 4 * rows
    return 8 * rows * hd + 4 * rows


def _linear_input_bytes(dm: _Dims, n_linears: int, in_bytes: int = 2, region: bool = False) -> int:
    """Saved inputs of ``n_linears`` linears reading one [n, d] fp32 tensor: a cast each under autocast
    (``in_bytes``: 2 for bf16, 1 for tensorwise fp8), the shared fp32 tensor otherwise. ``region``: the column-
    parallel linears of a tensor-parallel region (not fp8): with sp they save one shard of n_r tokens in the
    compute dtype, for all of them (megaloom.parallel.sp_linear)."""
    if region and dm.sp:
        return dm.a * dm.n_r * dm.d
    return n_linears * in_bytes * dm.n * dm.d if dm.autocast else 4 * dm.n * dm.d


def block_activation_bytes(cfg: Config, *, tokens: int, batch: int, layer: int = 0, tp: int = 1,
                           sp: bool = False, device: str = CUDA, recompute: str | None = None,
                           attention: str | None = None, grouped_mm: bool | None = None,
                           fp8: bool = False) -> dict[str, int]:
    """Bytes one transformer block saves for backward in one micro-batch, by what saves them (weight casts
    excluded: see `weight_cast_bytes`). ``tokens``: micro_batch x seq_len / cp on this rank; ``layer``: the
    block's index (MoE placement); ``fp8``: this block's linears run in float8."""
    m, t = cfg.model, cfg.train
    recompute = recompute or t.recompute
    dm = _dims(m, tokens, batch, compute_precision(cfg, device), tp, sp)
    if recompute == "full":  # the residual stream: fp32, or bf16 with train.bf16_residual under autocast
        residual = 2 if dm.autocast and getattr(t, "bf16_residual", False) is True else 4
        return {"block input (full recompute)": residual * dm.n_r * m.d_model}
    attention = attention or attention_backend(cfg, device, tp)
    moe = is_moe_layer(m, layer)
    # Compiled blocks: the partitioner's own save-set (selective recompute drops the SwiGLU product from it).
    if _compiled_save_set_known(cfg, dm, device, recompute, attention, moe, fp8):
        residual = 2 if dm.autocast and getattr(t, "bf16_residual", False) is True else 4
        return _compiled_block_bytes(m, dm, lean=t.recompute_casts is True, selective=recompute == "selective",
                                     residual=residual, alltoall_cp=_alltoall_cp(cfg))
    lin_in = 1 if fp8 and getattr(t, "fp8_recipe", "tensorwise") == "tensorwise" else 2
    attn_in = 2 if getattr(t, "fp8_keep_attention", False) else lin_in  # projections kept bf16: 2-byte inputs
    out: dict[str, int] = {}
    n, n_r, d, a = dm.n, dm.n_r, dm.d, dm.a
    tr = _traits(m)
    out["attn_norm"] = _norm_bytes(tr.norm, n_r, d, device)
    selective = recompute == "selective"
    if is_mla(m):  # multi-head latent attention: its own save-set (planning/memory_mla.py)
        out.update(mla_attention_bytes(m, n=n, n_r=n_r, b=dm.b, t=dm.t, heads=dm.hl, a=a, autocast=dm.autocast,
                                       sp=dm.sp, attention=attention, selective=selective, device=device,
                                       dropout_mask=_mask_bytes(device, 4)))
    else:
        out.update(_gqa_attention_bytes(cfg, dm, device, attention, selective, fp8, attn_in))
    if not m.parallel_block:
        out["mlp_norm"] = _norm_bytes(tr.norm, n_r, d, device)
    # fp32 and a parallel block: one normed x (or, with sp, its shard) saved for both branches; an MoE layer
    # gathers its own copy under sp (megaloom.parallel.expert).
    shares_input = not dm.autocast and m.parallel_block
    if moe:
        out.update(_moe_bytes(cfg, dm, device, grouped_mm, selective, shares_input and not dm.sp))
    else:
        gated = tr.gated_mlp
        out["mlp inputs"] = 0 if shares_input else _linear_input_bytes(dm, 2 if gated else 1, lin_in,
                                                                      region=not fp8)
        if gated:
            out["gate, up, silu, product"] = (3 if selective else 4) * a * n * dm.fl
        else:
            out["up, gelu"] = 2 * a * n * dm.fl
    if m.dropout > 0:  # masks of the residual dropouts on o_proj's and down_proj's outputs (MoE: its own)
        out["dropout masks"] = (1 if moe else 2) * _mask_bytes(device, a) * n_r * d
    return out


def _gqa_attention_bytes(cfg: Config, dm: _Dims, device: str, attention: str, selective: bool, fp8: bool,
                         attn_in: int) -> dict[str, int]:
    """The attention half of a grouped-query block's save-set (module doc: linears, QK-norm, attention)."""
    m, t = cfg.model, cfg.train
    n, a = dm.n, dm.a
    tr = _traits(m)
    out: dict[str, int] = {}
    # One tensor enters each region (with sp: its shard, saved once for the region's linears unless in fp8).
    keep_attn = bool(getattr(t, "fp8_keep_attention", False))
    out["q/k/v inputs"] = _linear_input_bytes(dm, 3, attn_in, region=not fp8 or keep_attn)
    if tr.qk_norm:  # an RMSNorm over each query and key head of the projections' outputs, before RoPE
        out["q/k norms"] = _qk_norm_bytes(n * (dm.hl + dm.hkvl), dm.hd, device, dm.autocast)
    q, kv = a * n * dm.hl * dm.hd, a * n * dm.hkvl * dm.hd
    if attention in ("flash", "efficient"):
        out["q, k, v"] = q + 2 * kv
        out["attention out"] = q  # o_proj reads it through a view (the kernels write [b, s, h, hd])
        # Selective recompute leaves the fused kernels' core alone (apply_recompute): its logsumexp stays saved.
        t_lse = 32 * math.ceil(dm.t / 32) if attention == "efficient" else dm.t  # efficient pads it to 32
        out["logsumexp"] = 4 * dm.b * dm.hl * t_lse
        if is_cuda(device):
            out["rng seed, offset"] = 16
        if m.sliding_window:  # boolean window mask converted to an additive one in the compute dtype
            t_pad = dm.t if not is_cuda(device) else 16 * math.ceil(dm.t / 16)
            out["window mask"] = a * dm.t * t_pad
    else:  # math: computed in fp32 (bf16/fp16 inputs are upcast); scaled q, k^T, v (k, v expanded to all heads)
        e = 4
        if selective:
            out["q, k, v"] = q + 2 * kv
        else:
            out["q, k, v (math)"] = 3 * e * n * dm.hl * dm.hd
            out["attention probs (math)"] = e * dm.b * dm.hl * dm.t * dm.t
            if m.dropout > 0:  # the mask (bool on CUDA, the input's dtype on CPU) and the dropped probs
                out["attention dropout (math)"] = (_mask_bytes(device, e) + e) * dm.b * dm.hl * dm.t * dm.t
        out["o_proj input (math)"] = a * n * dm.hl * dm.hd
    return out


def _alltoall_cp(cfg: Config) -> bool:
    """Whether attention runs in context parallelism's all-to-all (Ulysses) mode."""
    if cfg.parallel.cp == 1:
        return False
    from megaloom.parallel.context import choose_mode

    return choose_mode(cfg) == "alltoall"


def _compiled_save_set_known(cfg: Config, dm: _Dims, device: str, recompute: str, attention: str, moe: bool,
                             fp8: bool) -> bool:
    """Whether `_compiled_block_bytes` describes this block: a compiled dense pre-norm decoder block (RMSNorm,
    SwiGLU, RoPE, with or without QK-norm; no parallel block, window or dropout) under bf16/fp16 autocast with a
    fused attention kernel, no full recomputation or fp8. Tensor parallelism, with or without sp, and context
    parallelism's all-to-all exchanges trace into one graph (parallel/traced_comm.py); ring attention is one
    custom op in it (parallel/context/ring.py). Other blocks keep the eager save-set (an over-estimate of what
    compile keeps)."""
    m, t = cfg.model, cfg.train
    tr = _traits(m)
    return (is_cuda(device) and t.compile is True and dm.autocast
            and recompute in ("none", "selective") and not moe and not fp8
            and attention in ("flash", "cudnn", "efficient") and tr.norm == "rmsnorm"
            and tr.gated_mlp and tr.positions == "rope" and not tr.bias and not tr.post_norm
            and not m.parallel_block and not m.sliding_window and m.dropout == 0 and not is_mla(m))


def _compiled_block_bytes(m: ModelConfig, dm: _Dims, lean: bool, selective: bool = False,
                          residual: int = 4, alltoall_cp: bool = False) -> dict[str, int]:
    """What a compiled block (`_compiled_save_set_known`) saves for backward, as AOTAutograd's partitioner picks it
    (read with saved-tensor hooks on a compiled block: tests/test_compile_saves.py at tp 1, and tp 2 with and without
    sp in tests/parallel/test_world2.py). By default it keeps, besides the block input (``residual`` bytes an
    element: 2 with train.bf16_residual) and each norm's 1/rms: three [n, d] bf16 tensors (the normed inputs of
    attention and MLP, the attention output in the o_proj layout, or under tp its all-reduced output), q, k, v of
    this rank's heads, the attention output and its logsumexp, and three [n, ffn/tp] bf16 tensors (gate, up, their
    SwiGLU product); weight casts are counted apart. With ``lean`` (train.recompute_casts) it recomputes the normed
    inputs, the o_proj layout and the product from what it keeps: one [n, d] bf16 tensor (o_proj's output), gate
    and up; the fp32 weights it saves are parameters, resident anyway. With sequence parallelism the block input
    and norms hold n / tp tokens, the two normed inputs are kept as all-gathered ([n, d] bf16 each, lean or not:
    the partitioner does not recompute a collective) and o_proj's reduce-scattered output as a [n / tp, d] bf16
    shard. Selective recompute (``selective``; the fused attention core is never recomputed) drops the product
    either way. Which tensor is which is read from shapes; the byte counts are what the tests check. With QK-norm
    the q and k projections' outputs before their norms and the norms' 1/rms are kept too.

    Context parallelism (``dm`` holds this rank's tokens): ring attention saves what the flash kernel saves (q, k,
    v of the local tokens, its output, laid out for o_proj's view, and the log-sum-exp), so the set is the same.
    The all-to-all mode (``alltoall_cp``) saves the kernel's tensors for all tokens and 1/cp of the heads
    (the same bytes), plus o_proj's input, a copy in the local layout after the exchange back (q's bytes).
    Measured at cp 2, tp 1 and 2: tests/parallel/context/test_context_world.py."""
    n, n_r, d, a = dm.n, dm.n_r, dm.d, dm.a
    q, kv = a * n * dm.hl * dm.hd, a * n * dm.hkvl * dm.hd
    out = {
        "block input": residual * n_r * d,
        "norms 1/rms": 2 * 4 * n_r,
        "rope tables": 2 * 4 * dm.t * dm.hd,
    }
    if dm.sp:
        out["normed inputs, all-gathered (bf16)"] = 2 * a * n * d
        out["o_proj output shard (bf16)"] = a * n_r * d
    elif lean:
        out["o_proj output"] = a * n * d
    else:  # [n, d] all three, also with model.head_dim (heads x head_dim != d): tests/test_compile_saves.py
        out["[n, d] bf16 (normed inputs, o_proj input)"] = 3 * a * n * d
    out.update({
        "q, k, v": q + 2 * kv,
        "attention out": q,
        "logsumexp": 4 * dm.b * dm.hl * dm.t,
        "gate, up" + ("" if lean or selective else ", product"): (2 if lean or selective else 3) * a * n * dm.fl,
    })
    if _traits(m).qk_norm:
        out["q, k before their norms"] = q + kv
        out["q/k norms 1/rms"] = 4 * n * (dm.hl + dm.hkvl)
    if alltoall_cp:
        out["o_proj input (all-to-all layout)"] = q
    return out


def _moe_bytes(cfg: Config, dm: _Dims, device: str, grouped_mm: bool | None, selective: bool,
               shares_input: bool) -> dict[str, int]:
    m = cfg.model
    _, _, fe, _ = _resolved(m)
    n, d, a, e, k = dm.n, dm.d, dm.a, m.n_experts, m.top_k
    rows = n * k  # dropless: every (token, expert) pair; a capacity limit only lowers it
    if grouped_mm is None:
        grouped_mm = is_cuda(device) and dm.autocast and d % 8 == 0 and fe % 8 == 0
    out: dict[str, int] = {}
    out["router input"] = 0 if shares_input else _linear_input_bytes(dm, 1)
    out["router probs, top-k, weights"] = 4 * n * e + 8 * n * k + 4 * n * k + 8 * n
    out["dispatch index"] = 8 * rows
    if dm.autocast:
        out["expert inputs"] = (1 if grouped_mm else 2) * 2 * rows * d
    else:
        out["expert inputs"] = 4 * rows * d
    out["expert gate, up, silu, product"] = 4 * a * rows * fe
    out["combine (fp32)"] = 8 * rows * d + 4 * rows
    if grouped_mm:
        out["group offsets"] = 4 * e
    if m.n_shared_experts:
        fs = m.n_shared_experts * fe
        out["shared expert inputs"] = 2 * 2 * n * d if dm.autocast else 0
        out["shared expert hidden"] = (3 if selective else 4) * a * n * fs
    if m.aux_loss_weight:
        out["load-balancing loss"] = 4 * n + 4 * e
    if m.z_loss_weight:
        out["z-loss"] = 4 * n * e + 4 * n
    if m.dropout > 0:
        out["moe dropout mask"] = _mask_bytes(device, 4) * n * d
    return out


def _mask_bytes(device: str, input_bytes: int) -> int:
    """Dropout keeps a bool mask on CUDA (native_dropout) and a scaled noise tensor of the input's dtype on CPU."""
    return 1 if is_cuda(device) else input_bytes


def embedding_activation_bytes(cfg: Config, *, tokens: int, batch: int, tp: int = 1,
                               device: str = CUDA) -> dict[str, int]:
    m = cfg.model
    out = {"token ids": 8 * tokens}
    if tp > 1:
        out["vocab-parallel mask"] = tokens
    if _traits(m).positions == "learned":
        out["position ids"] = 8 * (tokens // batch)
    if m.dropout > 0:
        out["embedding dropout mask"] = _mask_bytes(device, 4) * tokens * m.d_model
    return out


def fused_loss(cfg: Config) -> bool:
    """train.fused_loss: the head and loss fused in chunks (megaloom.models.fused_ce; tensor parallelism uses its
    vocab-parallel loss instead)."""
    return getattr(cfg.train, "fused_loss", False) is True and cfg.parallel.tp == 1  # "auto": resolved by _layout


def _fused_chunk_tokens(vocab: int) -> int:
    try:
        from megaloom.models.fused_ce import default_chunk_tokens
    except ImportError:  # the same rule: one chunk's fp32 logits ~ 2**28 values, a multiple of 256 tokens
        return max(256, (2**28 // max(vocab, 1)) // 256 * 256)
    return default_chunk_tokens(vocab)


def head_activation_bytes(cfg: Config, *, tokens: int, tp: int = 1, sp: bool = False,
                          device: str = CUDA) -> dict[str, int]:
    """Saved by the final norm, the head and the loss for one micro-batch (the head's weight cast excluded)."""
    m = cfg.model
    autocast = compute_precision(cfg, device) != "fp32"
    n_r = tokens // tp if (sp and tp > 1) else tokens
    v = m.vocab_size // tp
    out = {"final norm": _norm_bytes(_traits(m).norm, n_r, m.d_model, device)}
    if fused_loss(cfg):  # the gradients are computed in the forward and kept for backward (fp32, as x and W)
        out["fused loss: grad of head input"] = 4 * tokens * m.d_model
        out["fused loss: grad of head weight"] = 4 * v * m.d_model + 4
        return out
    # With sp the head saves its input shard, gathered again in backward (megaloom.parallel.sp_linear).
    out["head input"] = (2 if autocast else 4) * n_r * m.d_model
    if tp > 1:
        out["softmax (fp32, vocab-parallel)"] = 4 * tokens * v
        out["labels"] = 8 * tokens + 2 * tokens + 8  # local labels, owned & valid masks, the token count
    else:
        out["log-softmax (fp32)"] = 4 * tokens * v
        out["labels"] = 8 * tokens + 4
    return out


def mtp_activation_bytes(cfg: Config, *, tokens: int, batch: int, tp: int = 1, sp: bool = False,
                         device: str = CUDA) -> dict[str, int]:
    """What multi-token prediction (model.mtp_depth, models/mtp.py) saves for backward in one micro-batch, on top
    of the head's bytes: per depth the token ids looked up, its two input norms (the states' norm shares its input
    with the norm before the head when that input is already fp32: the model's fp32 residual stream at depth 1, or
    any depth without autocast), the projection's input (the concatenation, or its bf16 cast), its block (indexed
    after the model's) and its own head and loss. Weight casts: `ParamCounts.matmul_mtp`."""
    m, t = cfg.model, cfg.train
    autocast = compute_precision(cfg, device) != "fp32"
    n_r = tokens // tp if (sp and tp > 1) else tokens
    d, norm = m.d_model, _traits(m).norm
    head = sum(head_activation_bytes(cfg, tokens=tokens, tp=tp, sp=sp, device=device).values())
    bf16_stream = autocast and getattr(t, "bf16_residual", False) is True
    eager = dataclasses.replace(cfg, train=dataclasses.replace(t, compile=False))
    out: dict[str, int] = {}
    for k in range(m.mtp_depth):
        shared = not autocast or (k == 0 and not bf16_stream)  # the states are fp32 already: one saved copy
        # the modules' blocks are neither recomputed nor compiled (train.recompute and train.compile take the
        # model's blocks): saved as eager blocks without recomputation
        block = block_activation_bytes(eager, tokens=tokens, batch=batch, layer=m.n_layers + k, tp=tp, sp=sp,
                                       device=device, recompute="none")
        out[f"mtp {k + 1}: token ids, norms, projection input"] = (
            8 * tokens + (tokens if tp > 1 else 0) + 2 * _norm_bytes(norm, n_r, d, device)
            - (4 * n_r * d if shared else 0) + (2 if autocast else 4) * n_r * 2 * d)
        out[f"mtp {k + 1}: block"] = sum(block.values())
        out[f"mtp {k + 1}: head and loss"] = head
    return out


def loss_transients(cfg: Config, *, tokens: int, tp: int = 1, device: str = CUDA) -> dict[str, int]:
    """Bytes live beyond the saved ones while the loss runs: forward (logits in the compute dtype and their
    fp32 copy) and backward (the fp32 gradients), per megaloom.models.transformer.cross_entropy (tp = 1) or
    megaloom.parallel.vocab_ce (tp > 1); and the head's backward (logit gradient, weight gradient). With
    train.fused_loss only one chunk of logits exists at a time (megaloom.models.fused_ce)."""
    m = cfg.model
    a = 4 if compute_precision(cfg, device) == "fp32" else 2
    v = m.vocab_size // tp
    d = m.d_model
    if fused_loss(cfg):
        c = min(tokens, _fused_chunk_tokens(v))
        cv = c * v
        if a == 2:  # bf16 W copy; per chunk: bf16 logits + fp32 copy, or the gradient's bf16 g + g^T x (bf16, fp32)
            fwd = 2 * v * d + 9 * tokens + 2 * c * d + max(6 * cv, 2 * cv + 6 * v * d)
        else:
            fwd = 9 * tokens + 4 * cv
        return {"loss forward": fwd, "loss backward": 4 * tokens * d + 4 * v * d, "head backward": 0}
    nv = tokens * v
    fp32_copy = 4 * nv if a == 2 else 0
    fwd = a * nv + fp32_copy
    if tp > 1:  # softmax saved (counted); grad = softmax * g (fp32) and its cast back to the logits' dtype
        bwd = 4 * nv + (2 * nv if a == 2 else 0)
    else:  # log-softmax output saved (counted); nll's gradient and log-softmax's gradient, both fp32
        bwd = 8 * nv
    # The logit gradient, the weight gradient in the compute dtype (added into an existing .grad) and, under
    # autocast, its fp32 copy (the backward of the weight's cast), the input gradient; log-softmax is freed by now.
    head_bwd = a * nv + (a + (4 if a == 2 else 0)) * v * d + a * tokens * d - 4 * nv
    return {"loss forward": fwd, "loss backward": bwd, "head backward": head_bwd}


# ----------------------------------------------------------------------------------------- parameters


@dataclass
class ParamCounts:
    """This rank's parameters (elements). ``local`` is what the rank stores; ``matmul`` what autocast casts to
    bf16 (linear, router and expert weights and the head; embedding lookups are not cast)."""

    local: int
    matmul_layers: dict[int, int]  # per block index on this rank
    matmul_head: int
    block_params: dict[int, int]  # all parameters per block (full size, for FSDP2's gathers)
    root_params: int  # embeddings, final norm, head
    largest: int  # the largest single parameter (optimizer temporaries)
    exact: bool  # counted from the module (True) or from the config
    embedding: int = 0  # the token embedding's weight on this rank (0 without one)
    expert: int = 0  # of ``local``, the expert-parallel weights (ZeRO shards them over edp, not dp x cp)
    frozen: int = 0  # parameters trained frozen (model.freeze): stored, but no gradient and no optimizer state
    matmul_mtp: int = 0  # the multi-token-prediction modules' matmul weights (model.mtp_depth; cast under autocast)


def _local_numel(p) -> int:
    return p.to_local().numel() if hasattr(p, "to_local") else p.numel()


def count_model_params(model: nn.Module) -> ParamCounts:
    """Exact counts from the built (parallelised / staged) module of this rank."""
    seen: set[int] = set()
    local = largest = root = 0
    mm_layers: dict[int, int] = {}
    blocks: dict[int, int] = {}
    head_w = getattr(getattr(model, "head", None), "weight", None)
    mm_head = head_w.numel() if head_w is not None else 0
    emb_w = getattr(getattr(model, "tok_emb", None), "weight", None)
    embedding = _local_numel(emb_w) if emb_w is not None else 0
    expert = frozen = mm_mtp = 0
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        nl = _local_numel(p)
        if p.requires_grad:
            local += nl
            expert += nl if layout_of(p).expert else 0
            largest = max(largest, nl)
        else:  # frozen (model.freeze): stored and cast all the same, but no gradient and no optimizer state
            frozen += nl
        parts = name.split(".")
        if parts[0] == "mtp" and p.ndim >= 2:
            mm_mtp += p.numel()
        if parts[0] == "layers" and len(parts) > 1 and parts[1].isdigit():
            i = int(parts[1])
            blocks[i] = blocks.get(i, 0) + p.numel()
            if p.ndim >= 2:
                mm_layers[i] = mm_layers.get(i, 0) + p.numel()
        else:
            root += p.numel()
    for i in blocks:
        mm_layers.setdefault(i, 0)
    return ParamCounts(local, mm_layers, mm_head, blocks, root, largest, exact=True, embedding=embedding,
                       expert=expert, frozen=frozen, matmul_mtp=mm_mtp)


def analytic_params(cfg: Config, layers: list[int], has_embedding: bool = True, has_head: bool = True,
                    tp: int = 1, ep: int = 1) -> ParamCounts:
    """The same counts from the config (no module): this rank's blocks ``layers``, embedding and head. MoE
    layers hold n_experts / ep experts, each split by hidden units over tp like the shared experts; the router
    is replicated."""
    m = cfg.model
    kv, ffn, fe, hd = _resolved(m)
    tr = _traits(m)
    d, bias = m.d_model, tr.bias
    qkv_bias = tr.bias or m.qkv_bias  # q/k/v biases (model.qkv_bias) without the others
    hkvl, q = max(kv // tp, 1), m.n_heads // tp * hd  # q: this rank's query heads x head width (d / tp by default)
    norm = 2 * d if tr.norm == "layernorm" else d  # LayerNorm: weight and bias
    qk_norm = 2 * hd if tr.qk_norm else 0  # q_norm, k_norm: one weight of head_dim each (replicated over tp)
    from megaloom.models.attention_shapes import attention_norm_params, attention_projections

    qk_norm += attention_norm_params(m)  # latent attention's norms over its latents (replicated over tp)
    projections = attention_projections(m, tp)
    mm_layers, blocks = {}, {}
    largest = expert = 0
    # multi-token prediction's blocks go with the head, indexed after the model's (models/mtp.py)
    mtp_blocks = list(range(m.n_layers, m.n_layers + m.mtp_depth)) if has_head else []
    for i in [*layers, *mtp_blocks]:
        attn_mm = sum(p.numel for p in projections)
        attn_b = ((q + 2 * hkvl * hd) if qkv_bias and not is_mla(m) else 0) + (d if bias else 0)
        if is_moe_layer(m, i):
            mlp_mm = (d * m.n_experts + 3 * (m.n_experts // ep) * d * (fe // tp)
                      + 3 * d * (m.n_shared_experts * fe // tp))
            expert += 3 * (m.n_experts // ep) * d * (fe // tp) if ep > 1 else 0
            mlp_b = 0
        else:
            mlp_mm = (3 if tr.gated_mlp else 2) * d * (ffn // tp)
            mlp_b = (ffn // tp + d) if bias else 0
        norms = norm * (1 if m.parallel_block else 2)
        mm_layers[i] = attn_mm + mlp_mm
        blocks[i] = attn_mm + mlp_mm + attn_b + mlp_b + norms + qk_norm
        largest = max(largest, d * (ffn // tp), (m.n_experts // ep) * d * (fe // tp) if is_moe_layer(m, i) else 0,
                      max(p.numel for p in projections))
    mtp_mm = sum(mm_layers.pop(i) + 2 * d * d for i in mtp_blocks)  # (+ eh_proj)
    root = sum(blocks.pop(i) + 2 * d * d + 3 * norm for i in mtp_blocks)  # (+ eh_proj and three norms)
    vocab = m.vocab_size // tp * d
    if has_embedding:
        root += vocab + (m.max_seq_len * d if tr.positions == "learned" else 0)
        root += tr.token_types * d + (norm if tr.embed_norm else 0)  # an encoder's segment embedding and its norm
    head_mm = 0
    if has_head:
        root += norm
        # An encoder's masked-LM head: the transform's dense layer (replicated) and the vocabulary bias (split).
        root += (d * d + d if tr.head_transform else 0) + (m.vocab_size // tp if tr.head_bias else 0)
        head_mm = vocab
        if not (m.tie_embeddings and has_embedding):
            root += vocab  # its own head weight (untied, or the tied copy on the last pipeline stage)
        if m.mtp_depth and not m.tie_embeddings and not has_embedding:
            root += vocab  # multi-token prediction's copy of the untied input embedding (pipeline/stage.py)
    if has_embedding or has_head:
        largest = max(largest, vocab)
    counts = ParamCounts(sum(blocks.values()) + root, mm_layers, head_mm, blocks, root, largest, exact=False,
                         embedding=vocab if has_embedding else 0, expert=expert, matmul_mtp=mtp_mm)
    return _with_adapters(counts, m, layers, tp) if m.lora.rank > 0 else counts


def _adapter_shapes(m: ModelConfig, tp: int, moe: bool) -> list[tuple[int, int]]:
    """(A, B) elements on one tp rank of each LoRA adapter of one block: a column-parallel base keeps A whole and
    its rows of B, a row-parallel one its columns of A and B whole (parallel/tp_lora.py)."""
    kv, ffn, _, hd = _resolved(m)
    d, r = m.d_model, m.lora.rank
    column_out = {"q_proj": d // tp, "k_proj": max(kv // tp, 1) * hd, "v_proj": max(kv // tp, 1) * hd,
                  "gate_proj": ffn // tp, "up_proj": ffn // tp}
    row_in = {"o_proj": d // tp, "down_proj": ffn // tp}
    out = []
    for t in m.lora.targets:
        if moe and t in ("gate_proj", "up_proj", "down_proj"):  # an MoE block has no dense MLP to adapt
            continue
        out.append((r * d, column_out[t] * r) if t in column_out else (r * row_in[t], d * r))
    return out


def _with_adapters(counts: ParamCounts, m: ModelConfig, layers: list[int], tp: int) -> ParamCounts:
    """model.lora: every base parameter trains frozen (stored, cast, but no gradient and no optimizer state); the
    adapters are what trains."""
    per_layer = {i: _adapter_shapes(m, tp, is_moe_layer(m, i)) for i in layers}
    sums = {i: sum(a + b for a, b in shapes) for i, shapes in per_layer.items()}
    largest = max((max(a, b) for shapes in per_layer.values() for a, b in shapes), default=0)
    return replace(counts, local=sum(sums.values()), frozen=counts.local, expert=0, largest=largest,
                               matmul_layers={i: n + sums[i] for i, n in counts.matmul_layers.items()},
                               block_params={i: n + sums[i] for i, n in counts.block_params.items()})


# ----------------------------------------------------------------------------------------------- the plan


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
            ("optimizer", self.optimizer, f"{s.get('optimizer')} exp_avg + exp_avg_sq (fp32)"
             + (" + 1-bit error feedback" if str(s.get("optimizer")).startswith("onebit") else "")),
            ("activations", self.activations, f"saved for backward: {self.layers} blocks x {layer / GB:.3f} GB + "
                                              f"embedding/head {s.get('embedding_head_bytes', 0) / GB:.3f} GB per "
                                              f"micro-batch, {self.in_flight} in flight"),
            ("weight casts", self.weight_casts, "autocast's bf16 weight copies (one set per micro-batch in flight)"),
            ("loss transient", self.loss_transient, "logits and fp32 loss gradients (largest moment)"),
            ("step transient", self.step_transient, "optimizer-step temporaries"),
            ("workspaces", self.workspace, "cuBLAS, 32 MiB per thread running matmuls"),
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
                      checkpoint_host=state.checkpoint_host, peak=peaks.phases[peak_phase],
                      peak_phase=peak_phase, phases=peaks.phases, per_layer=blocks.saved(first),
                      layers=len(rank.layers), in_flight=peaks.in_flight,
                      setup=_setup(lay, rank, acts, _grad_note(lay.zero, state)), notes=_notes(lay, rank.counts),
                      build=_build_peak(lay, rank.counts, state))


def _build_peak(lay: _Layout, counts: ParamCounts, state: _State) -> int:
    """What building this rank holds at most: its weights, the gradient buckets the data-parallel wrapper
    allocates at once (zero 0/1; zero 2 allocates them at the first backward), ZeRO's fp32 master shard (made
    with the optimizer; its moments come at the first step) and the largest parameter's initialisation
    temporary (models/init.py draws each tensor's values, then copies them into place)."""
    master = 4 * state.p_opt if state.optimizer > 8 * state.p_opt else 0
    return state.weights + state.grad_persistent + master + 4 * counts.largest


@dataclass(frozen=True)
class _Layout:
    """The quantities every part of the plan shares: the config (train.precision resolved) and this rank's
    place in the parallel layout."""

    cfg: Config  # train.precision resolved for the device ("auto" -> bf16 / fp32)
    device: str
    world_size: int
    tp: int
    pp: int
    vpp: int
    cp: int
    dp: int
    zero: int
    pp_rank: int
    n_micro: int  # micro-batches per step on this rank
    precision: str
    tokens: int  # per micro-batch on this rank: micro_batch x seq_len / cp
    batch: int  # sequences per micro-batch
    sp: bool  # sequence parallelism in effect (tp > 1)
    attention: str  # the SDPA save-set (`attention_backend`)
    update: bool = True  # steps call optimizer.step() (False: a dry run's steps without the update)

    @property
    def autocast(self) -> bool:
        return self.precision != "fp32"

    @property
    def n_r(self) -> int:
        """Tokens in the residual stream (tokens / tp with sequence parallelism)."""
        return self.tokens // self.tp if self.sp else self.tokens


def _layout(cfg: Config, world_size: int, device: str, pp_rank: int, n_micro: int | None,
            update: bool = True) -> _Layout:
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
    return _Layout(cfg=cfg, device=device, world_size=world_size, tp=tp, pp=pp, vpp=p.vpp, cp=cp, dp=dp,
                   zero=p.zero, pp_rank=pp_rank, n_micro=n_micro, precision=precision,
                   tokens=t.micro_batch_size * t.seq_len // cp, batch=t.micro_batch_size, sp=p.sp and tp > 1,
                   attention=attention_backend(cfg, device, tp), update=update)


# ------------------------------------------------------------------------------ this rank's blocks and parameters


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


def _rank_model(lay: _Layout, model: nn.Module | None) -> _RankModel:
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


def _fp8_layers(lay: _Layout) -> frozenset[int]:
    """fp8: the blocks whose linears save a 1-byte input and no weight copy (first/last kept in bf16 by default)."""
    if lay.precision != "fp8":
        return frozenset()
    m = lay.cfg.model
    keep = getattr(lay.cfg.train, "fp8_keep_first_last", True)
    return frozenset(i for i in range(m.n_layers) if not (keep and i in (0, m.n_layers - 1)))


# ------------------------------------------------------------------------------------- activations per stage


@dataclass(frozen=True)
class _Blocks:
    """One block of this rank, one micro-batch: what it saves and the weight casts it holds. recompute=full with
    recompute_layers=N: only the first N blocks of each stage recompute, the others keep everything."""

    lay: _Layout
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
        if not self.lay.autocast:
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


def _stage_activations(lay: _Layout, rank: _RankModel, blocks: _Blocks) -> _Activations:
    cfg, t = lay.cfg, lay.cfg.train
    full = t.recompute == "full"
    emb = sum(embedding_activation_bytes(cfg, tokens=lay.tokens, batch=lay.batch, tp=lay.tp,
                                         device=lay.device).values())
    head = sum(head_activation_bytes(cfg, tokens=lay.tokens, tp=lay.tp, sp=lay.sp, device=lay.device).values())
    head_cast = 2 * rank.counts.matmul_head if (lay.autocast and rank.has_head and not fused_loss(cfg)) else 0
    if rank.has_head and cfg.model.mtp_depth:  # multi-token prediction runs with the head: its saves and casts
        head += sum(mtp_activation_bytes(cfg, tokens=lay.tokens, batch=lay.batch, tp=lay.tp, sp=lay.sp,
                                         device=lay.device).values())
        head_cast += 2 * rank.counts.matmul_mtp if lay.autocast else 0
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


# ------------------------------------------------------------------------------------------- persistent state


@dataclass(frozen=True)
class _State:
    """Weights, optimizer state, gradients (persistent, and as they live through a step), FSDP2's gathered blocks
    and the CUDA workspaces."""

    weights: int
    optimizer: int
    p_opt: int  # parameters whose optimizer state this rank keeps
    grad_persistent: int
    grad_after_backward: int  # gradient bytes live once a backward of the step has run
    grad_at_step: int  # gradient bytes live during the optimizer step
    fsdp_gather: int
    workspace: int
    buckets: bool  # data parallel with flat gradient buckets (megaloom.parallel.data_parallel)
    fsdp: bool  # ZeRO-3 through FSDP2
    checkpoint_host: int = 0  # host bytes an async save adds (`_checkpoint_host`; not in a GPU's peak)

    @property
    def gradients(self) -> int:
        return self.grad_persistent + max(self.grad_at_step, self.grad_after_backward)

    @property
    def static(self) -> int:
        """Live at every event of the step."""
        return self.weights + self.optimizer + self.grad_persistent + self.workspace


def master_shards(cfg: Config, precision: str) -> bool:
    """ZeRO-1/2 gathering parameters in bf16 (parallel.param_gather=auto in bf16/fp8) keeps fp32 master shards."""
    return cfg.parallel.param_gather == "auto" and precision in ("bf16", "fp8")


def _persistent_state(lay: _Layout, counts: ParamCounts) -> _State:
    zero, dp, p_local = lay.zero, lay.dp, counts.local
    fsdp = zero == 3 and lay.world_size > 1
    onebit = lay.cfg.train.optimizer.startswith("onebit")  # on the buckets, in one process too (megaloom/onebit.py)
    buckets = (lay.world_size > 1 or onebit) and not fsdp  # pipelines too: each stage's gradients in buckets
    weights = 4 * (p_local + counts.frozen)  # frozen parameters are stored, fp32, whole on every replica
    # ZeRO shards dense parameters over dp x cp, expert weights over edp (the dp ranks holding the same experts)
    ep = lay.cfg.parallel.ep
    shard = (p_local - counts.expert) // (dp * lay.cp) + counts.expert // max(1, dp // ep * lay.cp)
    p_opt = shard if (zero >= 1 and buckets) or fsdp else p_local
    if fsdp and counts.exact:
        p_opt = p_local  # the module's parameters are already the 1/dp shards
    if fsdp and not counts.exact:
        weights, p_opt = 4 * (shard + counts.frozen), shard
    grad_persistent = 0
    if buckets:
        # zero 1 reduce-scatters in place (the 1/dp chunk is the bucket's own); zero 2 keeps its chunks apart
        grad_persistent = (4 * p_local if zero in (0, 1) else 0) + (4 * shard if zero == 2 else 0)
    full_local = sum(counts.block_params.values()) + counts.root_params  # unsharded (tp-local) size
    if buckets:
        grad_after_backward = 4 * p_local if zero == 2 else 0  # zero 2: buckets live from first grad to reduction
        grad_at_step = 0
    elif fsdp:
        grad_after_backward = 4 * full_local if lay.n_micro > 1 else 0  # FSDP2 accumulates unsharded without sync
        grad_at_step = 4 * p_opt
    else:
        grad_after_backward = grad_at_step = 4 * p_local
    fsdp_gather = 0
    if fsdp:  # FSDP2 all-gathers blocks just in time (current + prefetched); the root stays gathered
        blocks_sorted = sorted(counts.block_params.values(), reverse=True)
        fsdp_gather = 4 * (counts.root_params + sum(blocks_sorted[:2]))
    optimizer = 8 * p_opt
    if onebit:
        optimizer += 4 * p_opt if lay.cfg.train.optimizer == "onebit_lamb" else 0  # the fresh variance
        dense, expert = p_local - counts.expert, counts.expert
        for n, group in ((dense, dp * lay.cp), (expert, max(1, dp // ep * lay.cp))):
            if group > 1:  # compressed: worker error of every element, server error of this rank's chunk
                optimizer += 4 * n + 4 * n // group
    masters = buckets and zero in (1, 2) and dp > 1 and master_shards(lay.cfg, lay.precision)
    if masters:
        optimizer += 4 * p_opt  # fp32 master shard beside the bf16-rounded weights that the all-gather publishes
    optimizer = optimizer if lay.update else 0
    sharded = (zero >= 1 and buckets) or fsdp
    host = _checkpoint_host(lay, counts, optimizer, p_opt if sharded else p_local, masters)
    return _State(weights=weights, optimizer=optimizer, p_opt=p_opt,
                  grad_persistent=grad_persistent, grad_after_backward=grad_after_backward,
                  grad_at_step=grad_at_step, fsdp_gather=fsdp_gather,
                  workspace=CUBLAS_WORKSPACE if is_cuda(lay.device) else 0, buckets=buckets, fsdp=fsdp,
                  checkpoint_host=host)


def _largest_segment(cfg: Config, largest: int, dp: int) -> int:
    """The largest ZeRO segment (one parameter's part of a bucket's 1/dp chunk): a parameter of at least a bucket
    closes its own bucket, so it is split over dp; a smaller one may sit whole in one rank's chunk."""
    bucket = int(cfg.parallel.bucket_mb * 2**20) // 4
    return largest if largest < bucket else -(-largest // dp)


def _checkpoint_host(lay: _Layout, counts: ParamCounts, optimizer: int, written: int, masters: bool) -> int:
    """Host bytes an asynchronous save adds (checkpoint/async_save.py): on an accelerator the pinned copy of what
    this rank writes, its parameters' share (ZeRO-1/2: its own segment of the weights, or its fp32 master shard, which
    ``optimizer`` already counts; frozen parameters whole) and its optimizer state. 0 on CPU (the state is
    written where it lives) and without async saves."""
    c = lay.cfg.checkpoint
    if not is_accelerator(lay.device) or not c.async_save or not (c.every > 0 or c.final):
        return 0
    return (0 if masters else 4 * written) + 4 * counts.frozen + optimizer


# ----------------------------------------------------------------------------------------------- the step


@dataclass(frozen=True)
class _Peaks:
    phases: dict[str, int]  # the largest live bytes per phase (PHASES)
    activations: int  # saved bytes of the micro-batches in flight, at their largest
    weight_casts: int  # the weight casts live at that moment
    in_flight: int  # how many micro-batches (x chunks) were in flight then


def _play_events(lay: _Layout, rank: _RankModel, acts: _Activations, state: _State, step_transient: int) -> _Peaks:
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


# ----------------------------------------------------------------------------------------- notes and setup


def _grad_note(zero: int, state: _State) -> str:
    if state.fsdp:
        return "fp32 1/dp shards (FSDP2)"
    if state.buckets and zero == 2:
        return "fp32 1/dp shard; full buckets only from the first gradient to their reduction"
    if state.buckets:
        return "fp32 buckets (persistent)" + (", reduce-scattered in place" if zero else "")
    return "fp32 p.grad, allocated in backward, freed after the step"


def _notes(lay: _Layout, counts: ParamCounts) -> list[str]:
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


def _setup(lay: _Layout, rank: _RankModel, acts: _Activations, grad_note: str) -> dict:
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
    from megaloom.parallel.zero import STEP_GROUP_ELEMENTS

    t = cfg.train
    sharded = buckets and zero >= 1  # megaloom.parallel.zero.ShardedOptimizer over the buckets' 1/dp chunks
    if not update:
        opt = 0
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


# --------------------------------------------------------------------------------------- the trainer's report


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
