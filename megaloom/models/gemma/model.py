"""Gemma 2's decoder (Gemma Team 2024), as a `Transformer` subclass so that everything that builds, initialises,
parallelises, checkpoints, recomputes or converts a model handles it unchanged.

What differs from the shared decoder, all here:
- `GemmaRMSNorm`: ``x / rms(x) * (1 + w)``, computed in fp32, its weight initialised at 0 (so the norm starts as
  the identity scale, as Gemma's checkpoints store it);
- `GeGLU`: the gated MLP with a tanh-GeLU gate, ``down(gelu_tanh(gate x) * up x)``, the SwiGLU MLP's names;
- `GemmaBlock`: "sandwich" norms, a norm before and after each of attention and MLP
  (``x + post_norm(f(pre_norm(x)))``); even layers attend within ``model.sliding_window`` tokens, odd layers to
  the whole context (Gemma 2's alternating local / global layers; a window of 0 makes every layer global);
- `GemmaModel`: the token embedding scaled by sqrt(d_model) (in the embedding's dtype, as transformers does);
  heads of ``model.head_dim`` (256 in the released shapes), scaled by 1 / sqrt(head_dim);
- soft-capping, as every released Gemma 2 checkpoint has it: attention scores ``cap * tanh(s / cap)`` with
  ``model.attn_softcap`` (50; the attention core's math path, models/attention.py, since no fused kernel applies
  it) and the head's logits with ``model.final_softcap`` (30; `SoftCapped` around the head, the model's
  `output_head`, so every loss that calls it, the vocabulary-parallel one on its shard of the logits included, and
  generation see the capped logits; the head stays a plain linear layer that tensor parallelism splits as ever).
- ``model.query_pre_attn_scalar`` (Gemma 2 27B: 144, its heads 128 wide): scores scaled by its ^-1/2, not
  head_dim's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from megaloom.config import ModelConfig
from megaloom.model_keys.shape import resolved_ffn_dim, resolved_head_dim, resolved_kv_heads
from megaloom.models.attention import Attention, KVCache
from megaloom.models.documents import Documents
from megaloom.models.init import ZEROS, InitRule, draw_init_seed
from megaloom.models.layers import MLP, norm_input
from megaloom.models.transformer import CrossEntropyLoss, Span, Transformer, family_of

if TYPE_CHECKING:
    from megaloom.models.family import Family


class GemmaRMSNorm(nn.RMSNorm):
    """RMSNorm scaled by ``1 + weight`` (weight initialised at 0), in fp32, returned in the input's dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.rms_norm(x.float(), self.normalized_shape, None, self.eps)
        return (y * (1.0 + self.weight.float())).type_as(x)


class GeGLU(MLP):
    """``down(gelu_tanh(gate x) * up x)``: SwiGLU's layout (gate_proj, up_proj, down_proj) with a tanh-GeLU gate."""

    def __init__(self, d_model: int, ffn_dim: int, dropout: float):
        super().__init__(True, d_model, ffn_dim, False, dropout)

    def _act(self, up: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        return F.gelu(gate, approximate="tanh") * up


class SoftCapped:
    """Gemma 2's final-logit soft-capping around a head: ``cap * tanh(head(x) / cap)`` (elementwise, so a
    vocabulary-split head's shard of the logits is capped as the whole would be; in the logits' dtype, the loss
    reads them in fp32 as ever). A callable, not a module: the head keeps its one name (``head.weight``)."""

    def __init__(self, head: nn.Module, cap: float) -> None:
        self.head, self.cap = head, cap

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.head(x) / self.cap) * self.cap

    @property
    def weight(self) -> torch.Tensor:
        return self.head.weight


def is_local(layer_idx: int) -> bool:
    """Gemma 2's layer pattern: even layers attend within the sliding window, odd layers globally."""
    return layer_idx % 2 == 0


class GemmaBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        d, eps = cfg.d_model, cfg.norm_eps
        window = cfg.sliding_window if is_local(layer_idx) else 0
        self.attn_norm = GemmaRMSNorm(d, eps=eps)
        self.attn = Attention(d, cfg.n_heads, resolved_kv_heads(cfg), False, cfg.dropout, window,
                              qkv_bias=cfg.qkv_bias, head_dim=resolved_head_dim(cfg))
        self.attn.softcap = cfg.attn_softcap
        if cfg.query_pre_attn_scalar:  # (FA4's causal core applies 1 / sqrt(head_dim): SDPA takes this scale)
            self.attn.softmax_scale = cfg.query_pre_attn_scalar ** -0.5
        self.post_attn_norm = GemmaRMSNorm(d, eps=eps)
        self.mlp_norm = GemmaRMSNorm(d, eps=eps)
        self.mlp = GeGLU(d, resolved_ffn_dim(cfg), cfg.dropout)
        self.post_mlp_norm = GemmaRMSNorm(d, eps=eps)

    def forward(self, x: torch.Tensor, rope, cache: KVCache | None = None, pos: int = 0,
                docs: Documents | None = None) -> torch.Tensor:
        # As the shared Block: the residual stream leaves in the dtype it came in, the norms read fp32.
        dtype = x.dtype
        h = self.attn(self.attn_norm(norm_input(x, self.attn_norm)), rope, cache, pos, docs)
        x = x + self.post_attn_norm(norm_input(h, self.post_attn_norm))
        h = self.mlp(self.mlp_norm(norm_input(x, self.mlp_norm)))
        return (x + self.post_mlp_norm(norm_input(h, self.post_mlp_norm))).to(dtype)


class GemmaModel(Transformer):
    def __init__(self, cfg: ModelConfig, family: Family | None = None):
        nn.Module.__init__(self)  # the shared decoder's parts are built here, with Gemma's blocks and norms
        if cfg.vocab_size <= 0:
            raise ValueError("model.vocab_size must be resolved (> 0) before building the model")
        self.cfg, self.family = cfg, family or family_of(cfg)
        self.init_seed = draw_init_seed()  # first, as Transformer does (models/init.py)
        d = cfg.d_model
        self.tok_emb = nn.Embedding(cfg.vocab_size, d)
        self.drop = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleDict({str(i): GemmaBlock(cfg, i) for i in range(cfg.n_layers)})
        self.norm = GemmaRMSNorm(d, eps=cfg.norm_eps)
        self.head = nn.Linear(d, cfg.vocab_size, bias=False)
        self.loss = CrossEntropyLoss()
        self.tie_weights()
        shape = (cfg.max_seq_len, resolved_head_dim(cfg))  # filled by reset_buffers
        self.register_buffer("rope_cos", torch.empty(shape, dtype=torch.float32), persistent=False)
        self.register_buffer("rope_sin", torch.empty(shape, dtype=torch.float32), persistent=False)
        self.recompute_layers = 0
        self.residual_dtype = None
        self.seq_positions = None
        self.reset_parameters()

    def init_rule(self, name: str) -> InitRule:
        """Transformer's rules, but the (1 + w) norms' weights start at 0 (a scale of 1)."""
        module_name, _, _ = name.rpartition(".")
        if isinstance(dict(self.named_modules()).get(module_name), GemmaRMSNorm):
            return ZEROS
        return super().init_rule(name)

    def output_head(self):
        """The head, its logits soft-capped at model.final_softcap where set (read from self.head at each call, so
        a tensor-parallel swap of the head keeps the cap)."""
        return SoftCapped(self.head, self.cfg.final_softcap) if self.cfg.final_softcap else self.head

    def embed(self, tokens: torch.Tensor, pos: int = 0, positions: torch.Tensor | None = None) -> torch.Tensor:
        x = self.tok_emb(tokens)
        x = x * torch.tensor(self.cfg.d_model ** 0.5, dtype=x.dtype)  # Gemma's scale, rounded to x's dtype as HF
        x = self.drop(x)
        if self.residual_dtype is not None and torch.is_autocast_enabled(x.device.type):
            x = x.to(self.residual_dtype)
        return x

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None, caches: list[KVCache] | None = None,
                pos: int = 0, span: Span | None = None, seq_len: int | None = None,
                docs: Documents | None = None, **objective) -> torch.Tensor:
        """Transformer.forward; refuses document masks with a sliding window (below)."""
        if docs is not None and self.cfg.sliding_window:
            # The shared forward builds one document mask, with the window, for every layer; Gemma's global
            # layers would need a second one. Not built: without a window, document masks work as everywhere.
            raise ValueError("gemma: document masks (data.document_mask / reset_positions) with "
                             "model.sliding_window > 0 are not built (the global layers need a mask of their own)")
        return super().forward(x, labels, caches, pos, span, seq_len, docs, **objective)
