"""The decoder-only transformer shared by the families: a plain PyTorch module, shaped by a family's traits.

Nothing here knows about parallelism. Tensor / pipeline / data parallelism are applied afterwards by
`megaloom.parallel`, which reads the family's plan, swaps layers in place and keeps every parameter name
unchanged. A pipeline stage is this same module with the other stages' parts removed (`prune`): the embedding
only on the first stage, the final norm, head and loss only on the last, and ``layers`` keyed by the global
block index, so names (and checkpoints) never depend on the layout.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from megaloom.accelerator import CUDA
from megaloom.config import ModelConfig
from megaloom.model_keys.base import model_rules
from megaloom.model_keys.shape import (
    resolved_expert_ffn_dim,
    resolved_ffn_dim,
    resolved_head_dim,
    resolved_kv_heads,
)
from megaloom.models.attention import Attention, KVCache
from megaloom.models.attention_shapes import is_mla, rope_dim
from megaloom.models.documents import Documents
from megaloom.models.init import ONES, ZEROS, InitRule, draw_init_seed, fill_slice
from megaloom.models.layers import MLP, HeadTransform, Pooler, make_norm, norm_input, rope_scaling_of, rope_tables
from megaloom.models.lora import add_lora
from megaloom.models.lora import init_rule as lora_init_rule
from megaloom.models.mla import MLAttention
from megaloom.models.moe import MoE, is_moe_block
from megaloom.models.mtp import MTPModule, mtp_tokens_and_targets
from megaloom.models.traits import FamilyView


def family_of(cfg: ModelConfig) -> FamilyView:
    """The family named by ``cfg.arch``, for a decoder built without one (`Family.build` passes itself). Every family
    builds on this module, so it cannot import the registry that lists them: it asks the package's seam
    (`megaloom.model_keys.base.model_rules`, which megaloom/__init__.py wires to megaloom/models/rules.py)."""
    return model_rules().family(cfg.arch)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int = 0, family: FamilyView | None = None):
        super().__init__()
        tr = (family or family_of(cfg)).traits
        self.parallel = cfg.parallel_block
        self.post_norm = tr.post_norm  # BERT: norm(x + f(x)); the norms keep their names (attn_norm, mlp_norm)
        self.attn_norm = make_norm(tr.norm, cfg.d_model, cfg.norm_eps)
        if is_mla(cfg):  # multi-head latent attention (model.attention=mla) in place of the family's own
            self.attn = MLAttention(cfg)
        else:
            attention = tr.attention or Attention
            self.attn = attention(cfg.d_model, cfg.n_heads, resolved_kv_heads(cfg), tr.bias, cfg.dropout,
                                  cfg.sliding_window, qkv_bias=tr.bias or cfg.qkv_bias, norm_eps=cfg.norm_eps,
                                  head_dim=resolved_head_dim(cfg))
        self.attn.causal = tr.causal
        if not self.parallel:  # the parallel block reads one normed input for both branches
            self.mlp_norm = make_norm(tr.norm, cfg.d_model, cfg.norm_eps)
        ffn = resolved_ffn_dim(cfg)
        if is_moe_block(cfg, layer_idx):
            self.mlp = MoE(cfg.d_model, cfg.n_experts, cfg.top_k, resolved_expert_ffn_dim(cfg),
                           n_shared_experts=cfg.n_shared_experts, score_fn=cfg.router_score,
                           normalize_weights=cfg.moe_norm_topk,
                           aux_loss_weight=cfg.aux_loss_weight, z_loss_weight=cfg.z_loss_weight,
                           capacity_factor=cfg.capacity_factor, aux_free_bias_rate=cfg.aux_free_bias_rate,
                           n_groups=cfg.n_expert_groups, topk_groups=cfg.topk_groups,
                           routed_scaling=cfg.routed_scaling_factor,
                           dropout=cfg.dropout, init_std=cfg.init_std,
                           out_std=cfg.init_std / math.sqrt(2 * cfg.n_layers))
        else:
            self.mlp = MLP(tr.gated_mlp, cfg.d_model, ffn, tr.bias, cfg.dropout, tr.gelu)

    def forward(self, x: torch.Tensor, rope, cache: KVCache | None = None, pos: int = 0,
                docs: Documents | None = None) -> torch.Tensor:
        # The residual stream leaves in the dtype it came in (bf16 with train.bf16_residual; an MoE layer's fp32
        # combine would promote it); the norms read it in their weights' dtype (fp32 statistics).
        dtype = x.dtype
        if self.post_norm:
            x = self.attn_norm(norm_input(x + self.attn(x, rope, cache, pos, docs), self.attn_norm))
            return self.mlp_norm(norm_input(x + self.mlp(x), self.mlp_norm)).to(dtype)
        if self.parallel:
            h = self.attn_norm(norm_input(x, self.attn_norm))
            return (x + self.attn(h, rope, cache, pos, docs) + self.mlp(h)).to(dtype)
        x = x + self.attn(self.attn_norm(norm_input(x, self.attn_norm)), rope, cache, pos, docs)
        return (x + self.mlp(self.mlp_norm(norm_input(x, self.mlp_norm)))).to(dtype)


class CrossEntropyLoss(nn.Module):
    """The loss slot of the model: ``loss(head, x, labels)`` = mean token cross-entropy of ``head(x)`` in fp32.
    Parallel and fused variants replace this module (vocabulary-parallel: `parallel.vocab_ce.VocabParallelLoss`;
    chunked head + loss: `models.fused_ce.FusedHeadLoss`)."""

    def forward(self, head: nn.Module, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return cross_entropy(head(x), labels)


@dataclass(frozen=True)
class Span:
    """Which part of the model one forward runs: the blocks ``layers`` (global indices, in order), preceded
    by the embedding if ``embed`` and followed by the final norm, head and loss if ``head``. A pipeline chunk
    is one span; the whole model is the span of all blocks with both ends."""

    layers: tuple[int, ...]
    embed: bool = True
    head: bool = True


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, family: FamilyView | None = None):
        super().__init__()
        if cfg.vocab_size <= 0:
            raise ValueError("model.vocab_size must be resolved (> 0) before building the model")
        family = family or family_of(cfg)
        self.cfg, self.family = cfg, family
        # Initial values are a function of this seed, each parameter's name and the element's position
        # (models/init.py), so any layout can initialise its shards alone. Drawn first, before the submodules'
        # own default inits touch the generator (which they do on a real device and not on meta).
        self.init_seed = draw_init_seed()
        tr = family.traits
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        if tr.positions == "learned":
            self.pos_emb = nn.Embedding(cfg.max_seq_len, cfg.d_model)
        if tr.token_types:  # segment embedding (BERT): every token of a packed row is segment 0
            self.type_emb = nn.Embedding(tr.token_types, cfg.d_model)
        if tr.embed_norm:
            self.emb_norm = make_norm(tr.norm, cfg.d_model, cfg.norm_eps)
        self.drop = nn.Dropout(cfg.dropout)
        # Keyed by the global block index: a pipeline stage keeps its blocks under the same names.
        self.layers = nn.ModuleDict({str(i): Block(cfg, i, family) for i in range(cfg.n_layers)})
        # The module between the last block and the head: the final norm, or an encoder's masked-LM transform.
        self.norm = (HeadTransform(tr.norm, cfg.d_model, cfg.norm_eps) if tr.head_transform
                     else make_norm(tr.norm, cfg.d_model, cfg.norm_eps))
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=tr.head_bias)
        self.loss = CrossEntropyLoss()
        if cfg.mtp_depth:  # multi-token prediction (models/mtp.py): blocks after the last, indexed on from it
            self.mtp = nn.ModuleDict({str(k): MTPModule(tr.norm, cfg.d_model, cfg.norm_eps,
                                                        Block(cfg, cfg.n_layers + k, family))
                                      for k in range(cfg.mtp_depth)})
        # train.mtp_loss_weight (set by the trainer; DeepSeek-V3's 0.3 until then) and the last MTP loss (logged)
        self.mtp_loss_weight = 0.3
        self.last_mtp_loss: torch.Tensor | None = None
        # A pipeline's last stage without the embedding: the token lookup MTP uses (the head's tied rows)
        self.mtp_lookup = None
        if cfg.sentence_order:  # BERT's sentence-order prediction (ALBERT): pooled [CLS] -> in order / swapped
            self.pooler = Pooler(cfg.d_model)
            self.order_head = nn.Linear(cfg.d_model, 2)
        self.tie_weights()
        if tr.positions == "rope":  # filled by reset_buffers (below, through reset_parameters): computed once
            shape = (cfg.max_seq_len, rope_dim(cfg))
            self.register_buffer("rope_cos", torch.empty(shape, dtype=torch.float32), persistent=False)
            self.register_buffer("rope_sin", torch.empty(shape, dtype=torch.float32), persistent=False)
        self.recompute_layers = 0  # full recomputation of the first N blocks of each span (apply_recompute)
        # The residual stream's dtype under autocast (train.bf16_residual: bf16); None keeps the embedding's (fp32).
        self.residual_dtype: torch.dtype | None = None
        # Context parallelism (parallel/context) sets this: (local length, device) -> the global positions of this
        # rank's tokens, which are not contiguous under the load-balanced split. None: positions pos .. pos+T-1.
        self.seq_positions = None
        add_lora(self, cfg.lora)  # model.lora: adapters on the blocks' linears, initialised with the rest
        self.reset_parameters()

    @property
    def plan(self):
        """The family's parallel plan (what `megaloom.parallel.tensor.parallelize_tensor` applies; it adds the
        multi-token-prediction modules' entries, `tensor.with_mtp`)."""
        return self.family.plan

    def tie_weights(self) -> None:
        """Share the head with the token embedding. Call again after `to_empty()`, which unties them."""
        if self.cfg.tie_embeddings and self.head is not None and self.tok_emb is not None:
            self.head.weight = self.tok_emb.weight

    def tied_aliases(self) -> dict[str, str]:
        """State-dict names that are another name's tensor: the tied head is the embedding. (Wrappers such as
        FSDP2 may register a separate, unsharded tensor under the alias, so consumers go by this map.)"""
        both = self.head is not None and self.tok_emb is not None
        return {"head.weight": "tok_emb.weight"} if self.cfg.tie_embeddings and both else {}

    def tie_embeddings_active(self) -> bool:
        return self.head is not None and self.tok_emb is not None and self.head.weight is self.tok_emb.weight

    def init_rule(self, name: str) -> InitRule:
        """Megatron-style init of parameter ``name``: N(0, std) for weights and embeddings, output projections
        (o_proj, down_proj, the experts' w_down) N(0, std / sqrt(2 * n_layers)), norms 1, biases 0."""
        module_name, _, leaf = name.rpartition(".")
        module = dict(self.named_modules()).get(module_name)  # None for a pruned stage's tied embedding copy
        if (adapter := lora_init_rule(module, name)) is not None:  # LoRA: A as PEFT draws it, B zeros
            return adapter
        if isinstance(module, nn.LayerNorm | nn.RMSNorm):
            return ONES if leaf == "weight" else ZEROS
        if leaf == "bias":
            return ZEROS
        std = self.cfg.init_std
        if module_name.endswith(("o_proj", "down_proj")) or leaf == "w_down":
            std /= math.sqrt(2 * self.cfg.n_layers)
        return InitRule("normal", std)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Initialise every (full-size) parameter by `init_rule` from ``init_seed``, and the buffers. A sharded
        model is initialised by `megaloom.parallel.materialize`, which gives each shard the same values."""
        for name, p in self.named_parameters():
            fill_slice(p, p.shape, [0] * p.dim(), self.init_rule(name), self.init_seed, name)
        self.reset_buffers()

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """RoPE tables from the config; every other buffer (MoE balancing state) zero."""
        for name, b in self.named_buffers():
            if b.device.type != "meta" and name not in ("rope_cos", "rope_sin"):
                b.zero_()
        if hasattr(self, "rope_cos") and self.rope_cos.device.type != "meta":
            c = self.cfg
            cos, sin = rope_tables(rope_dim(c), c.max_seq_len, c.rope_theta, rope_scaling_of(c))
            self.rope_cos.copy_(cos)
            self.rope_sin.copy_(sin)

    def positions(self, t: int, pos: int, device) -> torch.Tensor:
        """Global positions of the t tokens this rank holds, starting at ``pos`` (or as context parallelism
        lays them out)."""
        if self.seq_positions is not None:
            return self.seq_positions(t, device)
        return torch.arange(pos, pos + t, device=device)

    def embed(self, tokens: torch.Tensor, pos: int = 0, positions: torch.Tensor | None = None,
              segments: torch.Tensor | None = None) -> torch.Tensor:
        x = self.tok_emb(tokens)
        if hasattr(self, "pos_emb"):
            if positions is None:
                positions = self.positions(tokens.shape[1], pos, tokens.device)
            x = x + self.pos_emb(positions)
        if getattr(self, "type_emb", None) is not None:
            # Segment ids [B, T] of the whole sequence (segment 0 everywhere unless the sentence-order objective
            # gives them); under sp the lookup keeps this rank's shard, as the positions' does.
            if segments is None:
                segments = torch.zeros(tokens.shape, dtype=torch.long, device=tokens.device)
            x = x + self.type_emb(segments)
        if getattr(self, "emb_norm", None) is not None:
            x = self.emb_norm(x)
        x = self.drop(x)
        if self.residual_dtype is not None and torch.is_autocast_enabled(x.device.type):
            x = x.to(self.residual_dtype)
        return x

    def rope(self, t: int, pos: int = 0, positions: torch.Tensor | None = None):
        """cos/sin [t, head_dim] of positions pos.., or [B, T, head_dim] of per-sample `positions`."""
        if not hasattr(self, "rope_cos"):
            return None
        if positions is not None:  # per sample (positions restarting at each document)
            return self.rope_cos[positions], self.rope_sin[positions]
        if self.seq_positions is not None:
            idx = self.seq_positions(t, self.rope_cos.device)
            return self.rope_cos[idx], self.rope_sin[idx]
        return self.rope_cos[pos:pos + t], self.rope_sin[pos:pos + t]

    def embedding_parts(self) -> list[str]:
        """Names of the modules that run before the first block (only the first pipeline stage keeps them)."""
        return [n for n in ("tok_emb", "pos_emb", "type_emb", "emb_norm") if getattr(self, n, None) is not None]

    def full_span(self) -> Span:
        return Span(tuple(int(i) for i in self.layers), self.tok_emb is not None, self.head is not None)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None, caches: list[KVCache] | None = None,
                pos: int = 0, span: Span | None = None, seq_len: int | None = None,
                docs: Documents | None = None, segments: torch.Tensor | None = None,
                order_labels: torch.Tensor | None = None) -> torch.Tensor:
        """Tokens [B, T] -> logits [B, T(/tp), V(/tp)] or, given labels [B, T], the mean next-token
        cross-entropy (fp32). ``span`` runs part of the model (a pipeline chunk): without the embedding ``x``
        is hidden states [B, T(/tp with sp), D] and ``seq_len`` the full sequence length; without the head
        the hidden states are returned. ``docs``: document boundaries of packed samples (models/documents.py):
        attention stays inside each document, and positions restart with each one if it carries them.
        ``segments`` [B, T]: segment ids (BERT); ``order_labels`` [B]: the sentence-order labels, which a model
        with the head (model.sentence_order) needs with ``labels``: the loss is then the masked-LM loss plus the
        sentence-order cross-entropy (mean over the rows)."""
        span = span or self.full_span()
        positions = docs.positions if docs is not None else None
        if docs is not None:  # the mask once for all layers; FlexAttention's block mask on GPUs (dropout: SDPA)
            docs = docs.with_mask(self.cfg.sliding_window, flex=x.device.type == CUDA and self.cfg.dropout == 0.0)
        if span.embed:
            seq_len = x.shape[1]
            if pos + seq_len > self.cfg.max_seq_len:
                raise ValueError(f"sequence of {pos + seq_len} tokens exceeds model.max_seq_len="
                                 f"{self.cfg.max_seq_len}")
            # (segment ids only when given: a subclass's embed, such as llava's, need not take them)
            x = self.embed(x, pos, positions) if segments is None else self.embed(x, pos, positions, segments)
        elif seq_len is None:
            raise ValueError("Transformer.forward: a span without the embedding needs seq_len (for RoPE)")
        rope = self.rope(seq_len, pos, positions)
        x = self.run_layers(x, rope, span.layers, caches, pos, docs)
        if not span.head:
            return x
        hidden = x  # the last block's states: what multi-token prediction continues from
        pooler = getattr(self, "pooler", None)
        if labels is not None and pooler is not None and order_labels is None:
            raise ValueError("Transformer.forward: a model with the sentence-order head (model.sentence_order) "
                             "needs order_labels with labels")
        order_loss = None
        if labels is not None and pooler is not None:  # the final hidden state at [CLS], before the MLM transform
            order_logits = self.order_head(pooler(x))
            order_loss = F.cross_entropy(order_logits.float(), order_labels.reshape(-1))
        x = self.norm(norm_input(x, self.norm))
        if labels is None:
            return self.output_head()(x)
        # Router auxiliary losses are not added here: each MoE layer attached their gradient to its output
        # (moe.attach_aux_loss), so the value returned is the language-model loss alone.
        loss = self.loss(self.output_head(), x, labels)
        if getattr(self, "mtp", None) is not None and self.training and torch.is_grad_enabled():
            loss = loss + self.mtp_term(hidden, labels, rope, docs)
        return loss if order_loss is None else loss + order_loss

    def output_head(self):
        """What turns the final hidden states into logits, for the loss slot and for logits alone: the head module
        (whatever tensor parallelism swapped in: looked up at each call), or a family's function of it (Gemma 2's
        soft-capped logits)."""
        return self.head

    def mtp_term(self, h: torch.Tensor, labels: torch.Tensor, rope, docs: Documents | None) -> torch.Tensor:
        """Multi-token prediction's part of the training loss: zero in value, ``mtp_loss_weight`` x the mean of the
        depths' losses in gradient (models/mtp.py); the mean is kept in ``last_mtp_loss``."""
        losses = []
        for k, module in enumerate(self.mtp.values(), start=1):
            tokens, targets = mtp_tokens_and_targets(labels, k)
            h = module(h, self.mtp_embedding(tokens), rope, docs)
            losses.append(self.loss(self.output_head(), module.norm(norm_input(h, module.norm)), targets))
        mean = torch.stack(losses).mean()
        self.last_mtp_loss = mean.detach()
        return self.mtp_loss_weight * (mean - mean.detach())

    def mtp_embedding(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token embeddings for multi-token prediction: the embedding's, or on a pipeline's last stage the lookup
        into the head's tied copy of it (parallel/pipeline/stage.py)."""
        if self.tok_emb is not None:
            return self.tok_emb(tokens)
        if self.mtp_lookup is None:
            raise RuntimeError("multi-token prediction on a stage without the embedding needs its copy "
                               "(parallel/pipeline/stage.py: the head's tied copy, or embedding_copy)")
        return self.mtp_lookup(tokens)

    def run_layers(self, x: torch.Tensor, rope, layers: Sequence[int], caches: list[KVCache] | None = None,
                   pos: int = 0, docs: Documents | None = None) -> torch.Tensor:
        for j, i in enumerate(layers):
            layer = self.layers[str(i)]
            if j < self.recompute_layers and torch.is_grad_enabled():
                x = checkpoint(layer, x, rope, None, 0, docs, use_reentrant=False)
            else:
                x = layer(x, rope, caches[i] if caches is not None else None, pos, docs)
        return x

    def blocks(self) -> list[tuple[int, Block]]:
        """(global index, block) of the blocks this module holds, in order."""
        return [(int(i), b) for i, b in self.layers.items()]

    @property
    def moe_layers(self) -> list[MoE]:
        return moe_layers(self)

    def new_caches(self, batch: int, max_len: int, dtype=None) -> list[KVCache]:
        first = next(iter(self.layers.values()))
        if isinstance(first.attn, MLAttention):  # the compressed latent and the shared RoPE key
            return [layer.attn.new_cache(batch, max_len, dtype) for layer in self.layers.values()]
        w = first.attn.k_proj.weight
        hd = resolved_head_dim(self.cfg)
        return [KVCache(batch, layer.attn.k_proj.out_features // hd, max_len, hd, dtype or w.dtype, w.device)
                for layer in self.layers.values()]


def build_on_device(cfg: ModelConfig, device: torch.device | str) -> Transformer:
    """Build the model directly on ``device`` (no full-size CPU copy first): construct on the meta device,
    allocate there, re-tie the embedding (`to_empty` unties it) and initialise. The values come from the
    device's RNG, so they differ from a CPU build with the same seed: the benchmarks use this, the trainer
    builds on CPU and moves, so that every rank and every layout starts from identical weights."""
    with torch.device("meta"):
        model = family_of(cfg).build(cfg)  # the family's module (t5, llava, gemma build their own)
    model = model.to_empty(device=device)
    model.tie_weights()
    model.reset_parameters()
    return model


def moe_layers(module: nn.Module) -> list[MoE]:
    """Every MoE layer inside `module` (a Transformer, a pipeline stage, a compiled block ...)."""
    return [m for m in module.modules() if isinstance(m, MoE)]


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy computed in fp32 (bf16 logits lose too much precision in log-softmax)."""
    return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.reshape(-1))


def apply_recompute(model: Transformer, mode: str, n_layers: int | None = None, core_attention: bool = True) -> None:
    """`full`: recompute whole blocks (the first n_layers, default all); `selective`: the MLP activation and, with
    ``core_attention``, the attention core, whose saved tensors are large but cheap to recompute (Korthikanti et
    al. 2022). The trainer passes ``core_attention`` only for the math kernel: the fused kernels (flash, cuDNN,
    efficient) save q, k, v and the output, which the projections keep anyway, plus a logsumexp, so recomputing
    them frees almost nothing and costs an attention forward (12% of the step at 64k tokens on an H200)."""
    model.recompute_layers = (n_layers if n_layers is not None else len(model.layers)) if mode == "full" else 0
    for layer in model.layers.values():
        layer.attn.recompute_core = mode == "selective" and core_attention
        layer.mlp.recompute_activation = mode == "selective"


def count_params(model: nn.Module, exclude_embeddings: bool = False) -> int:
    seen, n = set(), 0
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        if exclude_embeddings and (name.startswith("tok_emb") or name.startswith("pos_emb")):
            continue
        n += p.numel()
    return n
