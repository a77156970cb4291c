"""A Vision Transformer (ViT, CLIP's image tower): patch embedding, an optional class token, learned positions, a
LayerNorm before the blocks, then pre-norm blocks of bidirectional attention and a GeLU MLP.

The submodules carry the decoder's names (``layers.<i>.attn.q_proj``, ``mlp.up_proj`` / ``down_proj``, ``attn_norm``,
``mlp_norm``), so its tensor-parallel plan (`vit.plan.VISION_PLAN`) is written in the same styles as the
decoder's. Head counts are read from the projection shapes at run time, so tensor parallelism only swaps the
linear layers. No post-norm: LLaVA reads the last block's output before CLIP's ``post_layernorm``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megaloom.config import ModelConfig


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """CLIP's activation: x * sigmoid(1.702 x)."""
    return x * torch.sigmoid(1.702 * x)


ACTIVATIONS = {"quick_gelu": quick_gelu, "gelu": F.gelu}


class VisionAttention(nn.Module):
    """Multi-head self-attention over all patches (no causal mask), biases on all four projections."""

    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.head_dim = d_model // n_heads
        self.q_proj = nn.Linear(d_model, d_model)
        self.k_proj = nn.Linear(d_model, d_model)
        self.v_proj = nn.Linear(d_model, d_model)
        self.o_proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, -1, self.head_dim).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        y = F.scaled_dot_product_attention(q, k, v)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class VisionMLP(nn.Module):
    def __init__(self, d_model: int, ffn_dim: int, act: str):
        super().__init__()
        self.up_proj = nn.Linear(d_model, ffn_dim)
        self.down_proj = nn.Linear(ffn_dim, d_model)
        self.act = ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(x)))


class VisionBlock(nn.Module):
    def __init__(self, d_model: int, n_heads: int, ffn_dim: int, act: str, eps: float):
        super().__init__()
        self.attn_norm = nn.LayerNorm(d_model, eps=eps)
        self.attn = VisionAttention(d_model, n_heads)
        self.mlp_norm = nn.LayerNorm(d_model, eps=eps)
        self.mlp = VisionMLP(d_model, ffn_dim, act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # LayerNorms in their weights' dtype (fp32 statistics under autocast), as the decoder's norms.
        x = x + self.attn(self.attn_norm(x.float()))
        return x + self.mlp(self.mlp_norm(x.float()))


class VisionTransformer(nn.Module):
    """Images [N, 3, H, W] (normalised) -> features [N, (1 +) patches, vision_d_model]."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d = cfg.vision_d_model
        self.patch_size = cfg.patch_size
        self.n_patches = (cfg.image_size // cfg.patch_size) ** 2
        self.patch_emb = nn.Conv2d(3, d, kernel_size=cfg.patch_size, stride=cfg.patch_size, bias=False)
        self.cls = nn.Parameter(torch.empty(d)) if cfg.vision_cls else None
        self.pos_emb = nn.Embedding(self.n_patches + int(cfg.vision_cls), d)
        self.pre_norm = nn.LayerNorm(d, eps=cfg.vision_norm_eps)
        ffn = cfg.vision_ffn_dim or 4 * d
        self.layers = nn.ModuleDict({str(i): VisionBlock(d, cfg.vision_heads, ffn, cfg.vision_act, cfg.vision_norm_eps)
                                     for i in range(cfg.vision_layers)})

    @property
    def has_cls(self) -> bool:
        return self.cls is not None

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch_emb(images.to(self.patch_emb.weight.dtype)).flatten(2).transpose(1, 2)  # [N, P, D]
        if self.cls is not None:
            x = torch.cat([self.cls.to(x.dtype).expand(x.shape[0], 1, -1), x], dim=1)
        x = x + self.pos_emb.weight.to(x.dtype)
        x = self.pre_norm(x.float())
        for layer in self.layers.values():
            x = layer(x)
        return x
