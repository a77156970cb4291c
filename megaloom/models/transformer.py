"""The decoder-only transformer: a plain PyTorch module, GPT-2 or Llama style by config.

Nothing here knows about parallelism. Tensor / pipeline / data parallelism are applied afterwards by
`megaloom.parallel`, which swaps layers in place and keeps every parameter name unchanged.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from megaloom.config import ModelConfig
from megaloom.models.attention import Attention, KVCache
from megaloom.models.layers import MLP, make_norm, rope_tables
from megaloom.models.moe import MoE


def resolved_ffn_dim(cfg: ModelConfig) -> int:
    if cfg.ffn_dim:
        return cfg.ffn_dim
    if cfg.arch == "gpt2":
        return 4 * cfg.d_model
    return 256 * math.ceil(int(8 * cfg.d_model / 3) / 256)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int = 0):
        super().__init__()
        bias = cfg.arch == "gpt2"
        self.parallel = cfg.parallel_block
        self.attn_norm = make_norm(cfg.arch, cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg.d_model, cfg.n_heads, cfg.n_kv_heads or cfg.n_heads, bias, cfg.dropout,
                              cfg.sliding_window)
        if not self.parallel:  # the parallel block reads one normed input for both branches
            self.mlp_norm = make_norm(cfg.arch, cfg.d_model, cfg.norm_eps)
        if cfg.moe_every and (layer_idx + 1) % cfg.moe_every == 0:
            self.mlp = MoE(cfg.d_model, cfg.n_experts, cfg.top_k, cfg.expert_ffn_dim or resolved_ffn_dim(cfg),
                           n_shared_experts=cfg.n_shared_experts, score_fn=cfg.router_score,
                           aux_loss_weight=cfg.aux_loss_weight, z_loss_weight=cfg.z_loss_weight,
                           capacity_factor=cfg.capacity_factor, aux_free_bias_rate=cfg.aux_free_bias_rate,
                           dropout=cfg.dropout, init_std=cfg.init_std,
                           out_std=cfg.init_std / math.sqrt(2 * cfg.n_layers))
        else:
            self.mlp = MLP(cfg.arch, cfg.d_model, resolved_ffn_dim(cfg), bias, cfg.dropout)

    def forward(self, x: torch.Tensor, rope, cache: KVCache | None = None, pos: int = 0) -> torch.Tensor:
        if self.parallel:
            h = self.attn_norm(x)
            return x + self.attn(h, rope, cache, pos) + self.mlp(h)
        x = x + self.attn(self.attn_norm(x), rope, cache, pos)
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.vocab_size <= 0:
            raise ValueError("model.vocab_size must be resolved (> 0) before building the model")
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        if cfg.arch == "gpt2":
            self.pos_emb = nn.Embedding(cfg.max_seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = make_norm(cfg.arch, cfg.d_model, cfg.norm_eps)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.tie_weights()
        if cfg.arch == "llama":
            cos, sin = rope_tables(cfg.d_model // cfg.n_heads, cfg.max_seq_len, cfg.rope_theta)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        self.recompute_layers = 0  # full recomputation of the first N blocks (set by apply_recompute)
        # Hooks that megaloom.parallel replaces (tensor / sequence parallelism); identity on one device.
        self.loss_fn = cross_entropy
        # Optional fused head + loss, called as head_loss(head, x, labels) instead of loss_fn(head(x), labels)
        # (train.fused_loss: megaloom.models.fused_ce.fused_head_loss, chunked, never the full logits).
        self.head_loss = None
        self.seq_scatter = _identity
        self.seq_gather = _identity
        self.reset_parameters()

    def tie_weights(self) -> None:
        """Share the head with the token embedding. Call again after `to_empty()`, which unties them."""
        if self.cfg.tie_embeddings:
            self.head.weight = self.tok_emb.weight

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Megatron-style init: N(0, std) everywhere, output projections scaled by 1/sqrt(2 * n_layers)."""
        std = self.cfg.init_std
        out_std = std / math.sqrt(2 * self.cfg.n_layers)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                is_out = name.endswith("o_proj") or name.endswith("down_proj")
                nn.init.normal_(module.weight, 0.0, out_std if is_out else std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, 0.0, std)
            elif isinstance(module, nn.LayerNorm | nn.RMSNorm):
                module.reset_parameters()
            elif isinstance(module, MoE):  # stacked expert weights are not nn.Linear
                module.reset_parameters(std, out_std)
        if self.cfg.arch == "llama":
            cos, sin = rope_tables(self.cfg.d_model // self.cfg.n_heads, self.cfg.max_seq_len, self.cfg.rope_theta)
            self.rope_cos.copy_(cos)
            self.rope_sin.copy_(sin)

    def embed(self, tokens: torch.Tensor, pos: int = 0) -> torch.Tensor:
        x = self.tok_emb(tokens)
        if self.cfg.arch == "gpt2":
            x = x + self.pos_emb(torch.arange(pos, pos + tokens.shape[1], device=tokens.device))
        return self.drop(x)

    def rope(self, t: int, pos: int = 0):
        if self.cfg.arch != "llama":
            return None
        return self.rope_cos[pos:pos + t], self.rope_sin[pos:pos + t]

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None,
                caches: list[KVCache] | None = None, pos: int = 0) -> torch.Tensor:
        """Logits [B, T, V] or, given labels [B, T], the mean next-token cross-entropy (fp32)."""
        t = tokens.shape[1]
        if pos + t > self.cfg.max_seq_len:
            raise ValueError(f"sequence of {pos + t} tokens exceeds model.max_seq_len={self.cfg.max_seq_len}")
        x = self.seq_scatter(self.embed(tokens, pos))
        rope = self.rope(t, pos)
        for i, layer in enumerate(self.layers):
            cache = caches[i] if caches is not None else None
            if i < self.recompute_layers and torch.is_grad_enabled():
                x = checkpoint(layer, x, rope, use_reentrant=False)
            else:
                x = layer(x, rope, cache, pos)
        x = self.seq_gather(self.norm(x))
        if labels is None:
            return self.head(x)
        # Router auxiliary losses are not added here: each MoE layer attached their gradient to its output
        # (moe.attach_aux_loss), so the value returned is the language-model loss alone.
        if self.head_loss is not None:
            return self.head_loss(self.head, x, labels)
        return self.loss_fn(self.head(x), labels)

    @property
    def moe_layers(self) -> list[MoE]:
        return moe_layers(self)

    def new_caches(self, batch: int, max_len: int, dtype=None) -> list[KVCache]:
        w = self.layers[0].attn.k_proj.weight
        hd = self.cfg.d_model // self.cfg.n_heads
        return [KVCache(batch, layer.attn.k_proj.out_features // hd, max_len, hd, dtype or w.dtype, w.device)
                for layer in self.layers]


def build_on_device(cfg: ModelConfig, device: torch.device | str) -> Transformer:
    """Build the model directly on ``device`` (no full-size CPU copy first): construct on the meta device,
    allocate there, re-tie the embedding (`to_empty` unties it) and initialise. The values come from the
    device's RNG, so they differ from a CPU build with the same seed: the benchmarks use this, the trainer
    builds on CPU and moves, so that every rank and every layout starts from identical weights."""
    with torch.device("meta"):
        model = Transformer(cfg)
    model = model.to_empty(device=device)
    model.tie_weights()
    model.reset_parameters()
    return model


def moe_layers(module: nn.Module) -> list[MoE]:
    """Every MoE layer inside `module` (a Transformer, a pipeline stage, a compiled block ...)."""
    return [m for m in module.modules() if isinstance(m, MoE)]


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy computed in fp32 (bf16 logits lose too much precision in log-softmax)."""
    return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.reshape(-1))


def apply_recompute(model: Transformer, mode: str, n_layers: int | None = None) -> None:
    """`full`: recompute whole blocks (the first n_layers, default all); `selective`: only attention core
    and MLP activation, whose saved tensors are large but cheap to recompute (Korthikanti et al. 2022)."""
    model.recompute_layers = (n_layers if n_layers is not None else len(model.layers)) if mode == "full" else 0
    for layer in model.layers:
        layer.attn.recompute_core = mode == "selective"
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
