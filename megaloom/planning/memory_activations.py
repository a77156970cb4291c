"""What one micro-batch's activations hold for backward, block by block: the memory plan's activation half.

For each block of a family (its traits, not its name), the tensors autograd saves: eager per op, or the compiled
block's save-set where Inductor's partitioner is known (tensor and context parallel blocks included); the
embedding's, the head's and the loss's (fused or not), and multi-token prediction's. `memory_plan.py` adds them
per micro-batch in flight; the tests measure each against saved-tensor hooks (tests/planning/test_memory_plan.py).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from megaloom.accelerator import CUDA, compute_precision, is_cuda
from megaloom.config import Config, ModelConfig
from megaloom.model_keys.shape import (
    resolved_expert_ffn_dim,
    resolved_ffn_dim,
    resolved_head_dim,
    resolved_kv_heads,
)
from megaloom.models.attention_kernel import attention_backend
from megaloom.planning.memory_mla import is_mla, mla_attention_bytes


def _traits(m: ModelConfig):
    """The family's `megaloom.models.family.Traits`: what the plan asks instead of testing ``model.arch``."""
    from megaloom.models.registry import get_family

    return get_family(m.arch).traits


def _resolved(m: ModelConfig) -> tuple[int, int, int, int]:
    """(n_kv_heads, ffn_dim, expert_ffn_dim, head_dim) with the "auto" zeros filled in."""
    return resolved_kv_heads(m), resolved_ffn_dim(m), resolved_expert_ffn_dim(m), resolved_head_dim(m)


def is_moe_layer(m: ModelConfig, index: int) -> bool:
    from megaloom.models.moe import is_moe_block

    return is_moe_block(m, index)


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
    (``in_bytes``: 2 for bf16, 1 for tensorwise or blockwise fp8), the shared fp32 tensor otherwise. ``region``:
    the column-parallel linears of a tensor-parallel region (not fp8): with sp they save one shard of n_r tokens
    in the compute dtype, for all of them (megaloom.parallel.sp_linear)."""
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
    # tensorwise keeps x in fp8, blockwise x^T in fp8 tiles (+1/32 for their scales, left out); rowwise a bf16 x
    lin_in = 1 if fp8 and getattr(t, "fp8_recipe", "tensorwise") in ("tensorwise", "blockwise") else 2
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
    parallelism's all-to-all exchanges trace into one graph (parallel/borders.py); ring attention is one
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

