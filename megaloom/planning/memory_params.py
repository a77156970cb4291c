"""The memory plan's resident half: parameters, gradients, optimizer state and checkpoint buffers of one rank.

Counts come from the model built on the meta device when one is at hand (`count_model_params`), else from the
config alone (`analytic_params`, what a 16,384-GPU search uses); `_persistent_state` turns them into bytes for a
precision, ZeRO stage and optimizer (master shards, buckets, LoRA's adapters only), `_checkpoint_host` into the
host buffers of an asynchronous save.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from megaloom.accelerator import is_accelerator, is_cuda
from megaloom.config import Config, ModelConfig
from megaloom.parallel.data_parallel import param_gather_dtype
from megaloom.parallel.layout import layout_of
from megaloom.planning.memory_activations import _resolved, _traits, is_moe_layer
from megaloom.planning.memory_mla import is_mla

# cuBLAS takes its workspace from PyTorch's allocator, 32 MiB per thread that runs matmuls (Hopper; measured on
# an H200, torch 2.11): the training thread and autograd's backward thread.
CUBLAS_WORKSPACE = 2 * 32 * 2**20



@dataclass(frozen=True)
class RankLayout:
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
    optimizer_host: int = 0  # train.optimizer_offload: the masters, moments and gradient buffers in host memory

    @property
    def gradients(self) -> int:
        return self.grad_persistent + max(self.grad_at_step, self.grad_after_backward)

    @property
    def static(self) -> int:
        """Live at every event of the step."""
        return self.weights + self.optimizer + self.grad_persistent + self.workspace


def master_shards(cfg: Config, precision: str) -> bool:
    """ZeRO-1/2 gathering parameters in bf16 (parallel.param_gather=auto in bf16/fp8) keeps fp32 master shards."""
    return param_gather_dtype(cfg.parallel.param_gather, precision) == torch.bfloat16


def bf16_params(lay: RankLayout) -> bool:
    """train.bf16_params on a layout that takes it: the trainable (bucketed) weights held in bf16, their fp32
    values in the optimizer's masters (ZeRO-1/2's shards; every weight at zero 0, one process too); autocast
    then makes no weight copies."""
    return (lay.cfg.train.bf16_params is True and lay.zero in (0, 1, 2) and master_shards(lay.cfg, lay.precision))



def _muon_delta(lay: RankLayout, counts: ParamCounts, p_opt: int, full_local: int) -> int:
    """train.optimizer=muon (megaloom/optim/muon.py) against AdamW's 8 bytes per element: the blocks' matrices keep
    one fp32 momentum (4 bytes) instead of two moments, and one matrix at a time is gathered: a tp-local fp32
    buffer on every rank, the tp pieces and the whole matrix on its owner (the largest parameter bounds it). The
    blocks' share of this rank's elements is taken as their share of the model (their norms, ~0.1%, counted in)."""
    blocks = sum(counts.block_params.values())
    muon_share = p_opt * blocks // max(1, full_local)
    # the largest Muon matrix: at most the largest parameter (often the embedding, not Muon's) and a whole block
    matrix = min(counts.largest, max(counts.block_params.values(), default=0))
    return -4 * muon_share + 4 * matrix * (1 + 2 * lay.tp)


def _persistent_state(lay: RankLayout, counts: ParamCounts) -> _State:
    zero, dp, p_local = lay.zero, lay.dp, counts.local
    fsdp = zero == 3 and lay.world_size > 1
    onebit = lay.cfg.train.optimizer.startswith("onebit")  # on the buckets, in one process too (optim/onebit.py)
    # pipelines too: each stage's gradients in buckets; bf16 weights keep their fp32 gradients there, one process too
    buckets = (lay.world_size > 1 or onebit or bf16_params(lay)) and not fsdp
    # frozen parameters are stored, fp32 (whole but under ZeRO-3); train.bf16_params: the trainable ones in bf16
    weights = (2 if bf16_params(lay) else 4) * p_local + 4 * counts.frozen
    # ZeRO shards dense parameters over dp x cp, expert weights over edp (the dp ranks holding the same experts)
    ep = lay.cfg.parallel.ep
    shard = (p_local - counts.expert) // (dp * lay.cp) + counts.expert // max(1, dp // ep * lay.cp)
    p_opt = shard if (zero >= 1 and buckets) or fsdp else p_local
    if fsdp and counts.exact:
        p_opt = p_local  # the module's parameters are already the 1/dp shards
    frozen = counts.frozen  # exact counts hold FSDP2's local shards already
    if fsdp and not counts.exact:
        # ZeRO-3 shards the frozen parameters too (a LoRA base, a frozen tower), over dp x cp (frozen experts
        # would be over edp: not told apart here, so slightly under)
        frozen = counts.frozen // (dp * lay.cp)
        weights, p_opt = 4 * (shard + frozen), shard
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
    if lay.cfg.train.optimizer == "muon":
        optimizer += _muon_delta(lay, counts, p_opt, full_local)
    if onebit:
        optimizer += 4 * p_opt if lay.cfg.train.optimizer == "onebit_lamb" else 0  # the fresh variance
        optimizer += 4 * p_opt if lay.cfg.train.onebit_variance_window > 0 else 0  # the window's g^2 (warm-up)
        dense, expert = p_local - counts.expert, counts.expert
        for n, group in ((dense, dp * lay.cp), (expert, max(1, dp // ep * lay.cp))):
            if group > 1:  # compressed: worker error of every element, server error of this rank's chunk
                optimizer += 4 * n + 4 * n // group
    masters = (buckets and zero in (1, 2) and dp > 1 and master_shards(lay.cfg, lay.precision)) or bf16_params(lay)
    if masters:  # (zero 0 with bf16 weights: p_opt is every weight)
        optimizer += 4 * p_opt  # fp32 master shard beside the bf16-rounded weights that the all-gather publishes
    optimizer = optimizer if lay.update else 0
    sharded = (zero >= 1 and buckets) or fsdp
    host = _checkpoint_host(lay, frozen, optimizer, p_opt if sharded else p_local, masters)
    optimizer_host = 0
    if lay.cfg.train.optimizer_offload and lay.update:
        # megaloom/optim/offload.py: the fp32 masters, both moments and the gradients' landing buffer of this rank's
        # p_opt elements live on the host; the device keeps none. An async save then writes that host state in place
        # (checkpoint/async_save.py: no copy) unless frozen weights on the device make it copy everything.
        optimizer, optimizer_host = 0, 16 * p_opt
        host = _checkpoint_host(lay, frozen, 12 * p_opt, 0, True) if frozen else 0
    return _State(weights=weights, optimizer=optimizer, p_opt=p_opt,
                  grad_persistent=grad_persistent, grad_after_backward=grad_after_backward,
                  grad_at_step=grad_at_step, fsdp_gather=fsdp_gather,
                  workspace=CUBLAS_WORKSPACE if is_cuda(lay.device) else 0, buckets=buckets, fsdp=fsdp,
                  checkpoint_host=host, optimizer_host=optimizer_host)


def _largest_segment(cfg: Config, largest: int, dp: int) -> int:
    """The largest ZeRO segment (one parameter's part of a bucket's 1/dp chunk): a parameter of at least a bucket
    closes its own bucket, so it is split over dp; a smaller one may sit whole in one rank's chunk."""
    bucket = int(cfg.parallel.bucket_mb * 2**20) // 4
    return largest if largest < bucket else -(-largest // dp)


def _checkpoint_host(lay: RankLayout, frozen: int, optimizer: int, written: int, masters: bool) -> int:
    """Host bytes an asynchronous save adds (checkpoint/async_save.py): on an accelerator the pinned copy of what
    this rank writes, its parameters' share (ZeRO-1/2: its own segment of the weights, or its fp32 master shard, which
    ``optimizer`` already counts; ``frozen``: the frozen parameters it holds, whole but under ZeRO-3) and its
    optimizer state. 0 on CPU (the state is written where it lives) and without async saves."""
    c = lay.cfg.checkpoint
    if not is_accelerator(lay.device) or not c.async_save or not (c.every > 0 or c.final):
        return 0
    return (0 if masters else 4 * written) + 4 * frozen + optimizer

