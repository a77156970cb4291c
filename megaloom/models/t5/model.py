"""T5's encoder-decoder (Raffel et al. 2020; T5 v1.1 / Flan-T5 blocks), as a `Transformer` subclass so that every
part of megaloom that builds, initialises, checkpoints, recomputes or converts a model handles it unchanged.

- one shared token embedding ``tok_emb`` for both stacks (and, tied, the head: decoder output scaled by
  d_model^-0.5 first, as T5 does);
- no position embeddings: a learned bias per head and relative-position bucket is added to the attention scores
  (``enc_bias``: buckets of both directions; ``dec_bias``: of the past only), computed once per forward and shared
  by every layer of its stack; attention scores are not scaled by 1/sqrt(head_dim) (T5 folds it into the init);
- tensor parallelism (the family's plan): heads, MLP units and vocabulary split as in the decoder; the bias
  tables split by heads; the encoder's output enters the decoder's regions once (``enc_out``);
- pre-norm blocks with RMSNorm and a gated-GeLU MLP (``gate_proj`` = wi_0 under GeLU-tanh, ``up_proj`` = wi_1,
  ``down_proj`` = wo), no biases; decoder blocks add cross-attention ``cross`` (``cross_norm``) over the
  encoder's output;
- ``layers`` holds the encoder's blocks under 0..n-1 and the decoder's under n..2n-1 (so recomputation and
  per-block compile reach them all); ``enc_norm`` / ``norm`` are the two stacks' final norms.

`forward(x, labels)` takes the span-corruption layout (spans.py): the encoder input followed by the decoder
input in one row, split by `spans.encoder_length`; `seq2seq(enc, dec)` is the plain interface.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from megaloom.config import ModelConfig
from megaloom.model_keys.shape import resolved_ffn_dim
from megaloom.models.attention import KVCache
from megaloom.models.init import draw_init_seed
from megaloom.models.lora import add_lora
from megaloom.models.t5.spans import encoder_length
from megaloom.models.transformer import CrossEntropyLoss, Transformer, family_of

NUM_BUCKETS, MAX_DISTANCE = 32, 128  # T5's relative_attention_num_buckets / _max_distance


def relative_buckets(rel: torch.Tensor, bidirectional: bool, num_buckets: int = NUM_BUCKETS,
                     max_distance: int = MAX_DISTANCE) -> torch.Tensor:
    """T5's bucket of each relative position ``rel`` = key position - query position: exact for small
    distances, logarithmic up to ``max_distance``; a bidirectional stack gives each direction half the buckets."""
    out = torch.zeros_like(rel)
    if bidirectional:
        num_buckets //= 2
        out += (rel > 0).long() * num_buckets
        n = rel.abs()
    else:
        n = -torch.clamp(rel, max=0)
    exact = num_buckets // 2
    large = exact + (torch.log(n.float() / exact) / math.log(max_distance / exact) * (num_buckets - exact)).long()
    large = torch.clamp(large, max=num_buckets - 1)
    return out + torch.where(n < exact, n, large)


def position_bias(table: nn.Linear, t: int, bidirectional: bool) -> torch.Tensor:
    """[1, heads, t, t] bias of a stack's self-attention; the decoder's also masks the future (-inf). ``table``'s
    weight is [heads, buckets]: a Linear, so that tensor parallelism splits it by heads as a column-parallel
    layer (each rank then holds, and computes the bias of, its own heads)."""
    pos = torch.arange(t, device=table.weight.device)
    bias = table.weight[:, relative_buckets(pos[None, :] - pos[:, None], bidirectional)].unsqueeze(0)
    if not bidirectional:
        bias = bias.masked_fill(pos[None, :] > pos[:, None], float("-inf"))
    return bias


class T5Attention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, dropout: float):
        super().__init__()
        self.head_dim = d_model // n_heads
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(d_model, d_model, bias=False)
                                                              for _ in range(4))
        self.attn_dropout = dropout
        self.resid_dropout = nn.Dropout(dropout)
        self.recompute_core = False  # selective recomputation: the attention core again in backward

    def _core(self, q, k, v, bias):
        p = self.attn_dropout if self.training else 0.0
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=p, scale=1.0)

    def keys_values(self, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [B, H, S, D] of ``src`` (a cross-attention's, computed once per generation)."""
        b, n = src.shape[:2]
        return (self.k_proj(src).view(b, n, -1, self.head_dim).transpose(1, 2),
                self.v_proj(src).view(b, n, -1, self.head_dim).transpose(1, 2))

    def forward(self, x: torch.Tensor, kv: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                cache: KVCache | None = None, pos: int = 0, kv_states: tuple | None = None):
        """``kv``: the sequence attended to (None: ``x``); ``kv_states``: its keys and values already projected;
        ``cache``: a decoder's self-attention KV cache, ``x`` then holding the tokens from position ``pos``."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k, v = kv_states if kv_states is not None else self.keys_values(x if kv is None else kv)
        if cache is not None:
            k, v = cache.update(k, v, pos)
        if bias is not None:
            bias = bias.to(q.dtype)
        if self.recompute_core and torch.is_grad_enabled():
            y = checkpoint(self._core, q, k, v, bias, use_reentrant=False)
        else:
            y = self._core(q, k, v, bias)
        return self.resid_dropout(self.o_proj(y.transpose(1, 2).reshape(b, t, -1)))


class T5MLP(nn.Module):
    """down(dropout(gelu_tanh(gate x) * up x)): T5 v1.1's gated-GeLU (wi_0, wi_1, wo)."""

    def __init__(self, d_model: int, ffn_dim: int, dropout: float):
        super().__init__()
        self.gate_proj = nn.Linear(d_model, ffn_dim, bias=False)
        self.up_proj = nn.Linear(d_model, ffn_dim, bias=False)
        self.down_proj = nn.Linear(ffn_dim, d_model, bias=False)
        self.inner_dropout, self.dropout = nn.Dropout(dropout), nn.Dropout(dropout)
        self.recompute_activation = False

    @staticmethod
    def _act(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.gelu(gate, approximate="tanh") * up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        if self.recompute_activation and torch.is_grad_enabled():
            h = checkpoint(self._act, gate, up, use_reentrant=False)
        else:
            h = self._act(gate, up)
        return self.dropout(self.down_proj(self.inner_dropout(h)))


class T5Block(nn.Module):
    def __init__(self, cfg: ModelConfig, cross: bool):
        super().__init__()
        d = cfg.d_model
        self.attn_norm = nn.RMSNorm(d, eps=cfg.norm_eps)
        self.attn = T5Attention(d, cfg.n_heads, cfg.dropout)
        if cross:
            self.cross_norm = nn.RMSNorm(d, eps=cfg.norm_eps)
            self.cross = T5Attention(d, cfg.n_heads, cfg.dropout)
        self.mlp_norm = nn.RMSNorm(d, eps=cfg.norm_eps)
        self.mlp = T5MLP(d, resolved_ffn_dim(cfg), cfg.dropout)

    def forward(self, x: torch.Tensor, bias: torch.Tensor, enc: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), None, bias)
        if enc is not None:
            x = x + self.cross(self.cross_norm(x), enc)
        return x + self.mlp(self.mlp_norm(x))


class T5Model(Transformer):
    def __init__(self, cfg: ModelConfig, family=None):
        nn.Module.__init__(self)
        if cfg.vocab_size <= 0:
            raise ValueError("model.vocab_size must be resolved (> 0) before building the model")
        self.cfg, self.family = cfg, family or family_of(cfg)
        self.init_seed = draw_init_seed()
        d, n = cfg.d_model, cfg.n_layers
        self.tok_emb = nn.Embedding(cfg.vocab_size, d)
        self.enc_bias = nn.Linear(NUM_BUCKETS, cfg.n_heads, bias=False)  # tables [heads, buckets]
        self.dec_bias = nn.Linear(NUM_BUCKETS, cfg.n_heads, bias=False)
        self.drop = nn.Dropout(cfg.dropout)
        # The encoder's output enters the decoder's tensor-parallel regions here, once for every cross-attention:
        # an identity whose plan entry is Region (copy to tp, or with sp the all-gather of the sequence shards).
        self.enc_out = nn.Identity()
        self.layers = nn.ModuleDict({str(i): T5Block(cfg, cross=i >= n) for i in range(2 * n)})
        self.enc_norm = nn.RMSNorm(d, eps=cfg.norm_eps)
        self.norm = nn.RMSNorm(d, eps=cfg.norm_eps)
        self.head = nn.Linear(d, cfg.vocab_size, bias=False)
        self.loss = CrossEntropyLoss()
        self.tie_weights()
        self.recompute_layers = 0
        self.residual_dtype = None
        self.seq_positions = None
        add_lora(self, cfg.lora)  # model.lora (models/lora.py), as the decoder's constructor does
        self.reset_parameters()

    def embedding_parts(self) -> list[str]:
        return ["tok_emb"]

    def _stack(self, x: torch.Tensor, layers: range, bias: torch.Tensor, enc: torch.Tensor | None) -> torch.Tensor:
        for j, i in enumerate(layers):
            layer = self.layers[str(i)]
            if j < self.recompute_layers and torch.is_grad_enabled():
                x = checkpoint(layer, x, bias, enc, use_reentrant=False)
            else:
                x = layer(x, bias, enc)
        return x

    def encode(self, ids: torch.Tensor) -> torch.Tensor:
        n = self.cfg.n_layers
        x = self._stack(self.drop(self.tok_emb(ids)), range(n), position_bias(self.enc_bias, ids.shape[1], True), None)
        return self.enc_out(self.drop(self.enc_norm(x)))

    def seq2seq(self, enc_ids: torch.Tensor, dec_ids: torch.Tensor, labels: torch.Tensor | None = None):
        """Encoder tokens [B, Te], decoder input tokens [B, Td] -> logits [B, Td, V], or with labels [B, Td] the
        mean cross-entropy over labels != -100."""
        n, enc = self.cfg.n_layers, self.encode(enc_ids)
        bias = position_bias(self.dec_bias, dec_ids.shape[1], False)
        x = self._stack(self.drop(self.tok_emb(dec_ids)), range(n, 2 * n), bias, enc)
        x = self.drop(self.norm(x))
        if self.tie_embeddings_active():  # T5 scales the decoder's output before the tied head
            x = x * self.cfg.d_model ** -0.5
        return self.head(x) if labels is None else self.loss(self.head, x, labels)

    @torch.no_grad()
    def start_decoding(self, enc_ids: torch.Tensor, max_len: int) -> dict:
        """Generation: run the encoder once on ``enc_ids`` and prepare the decoder's state for up to ``max_len``
        tokens: a KV cache per decoder layer, every cross-attention's keys and values, the bias table."""
        enc, n = self.encode(enc_ids), self.cfg.n_layers
        decoder = [self.layers[str(i)] for i in range(n, 2 * n)]
        w = decoder[0].attn.k_proj.weight
        hd = decoder[0].attn.head_dim
        return {"caches": [KVCache(enc_ids.shape[0], w.shape[0] // hd, max_len, hd, w.dtype, w.device)
                           for _ in decoder],
                "cross": [layer.cross.keys_values(enc) for layer in decoder],
                "bias": position_bias(self.dec_bias, max_len, False)}

    @torch.no_grad()
    def decode_step(self, tokens: torch.Tensor, state: dict, pos: int) -> torch.Tensor:
        """Logits [B, t, V] of decoder tokens [B, t] at positions pos.. (the earlier ones are in the caches)."""
        n, t = self.cfg.n_layers, tokens.shape[1]
        bias = state["bias"][:, :, pos:pos + t, :pos + t]
        x = self.drop(self.tok_emb(tokens))
        for j, i in enumerate(range(n, 2 * n)):
            layer = self.layers[str(i)]
            x = x + layer.attn(layer.attn_norm(x), None, bias, cache=state["caches"][j], pos=pos)
            x = x + layer.cross(layer.cross_norm(x), kv_states=state["cross"][j])
            x = x + layer.mlp(layer.mlp_norm(x))
        x = self.drop(self.norm(x))
        if self.tie_embeddings_active():
            x = x * self.cfg.d_model ** -0.5
        return self.head(x)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None, span=None, **kwargs) -> torch.Tensor:
        """A span-corruption row [B, Te + Td] (encoder input, then decoder input; spans.py) -> decoder logits or,
        with labels [B, Te + Td] (-100 over the encoder part), the loss. No pipeline spans, caches or documents."""
        if span is not None or kwargs.get("caches") is not None or kwargs.get("docs") is not None:
            raise ValueError("T5Model runs whole samples only (no pipeline span, KV cache or document masks)")
        te = encoder_length(x.shape[1])
        return self.seq2seq(x[:, :te], x[:, te:], None if labels is None else labels[:, te:])
