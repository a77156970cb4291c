"""DeepSeek-V3's multi-token prediction (``model.mtp_depth`` = D > 0): D sequential modules after the last block.

Module k (1..D) combines, at every position i, the previous depth's states h^{k-1}_i (h^0: the last block's
output, before the final norm) with the embedding of token t_{i+k}, and predicts t_{i+k+1}:

    h'^k_i = eh_proj([enorm(Emb(t_{i+k})) ; hnorm(h^{k-1}_i)])     (embedding first, as the released eh_proj)
    h^k    = block_k(h')                                            a transformer block of the model's kind
    loss_k = CE(head(norm_k(h^k_i)), t_{i+k+1})                     the model's own head and loss module

The embedding and head are the main model's (shared, as in DeepSeek-V3), the loss is the model's loss slot (so
the fused head + loss and the vocabulary-parallel loss apply), and training adds
``weight * mean_k loss_k`` to the language-model loss (DeepSeek-V3: weight 0.3, then 0.1). What the model returns
keeps the language-model loss as its value: the MTP term enters as ``weight * (l - l.detach())``, zero in value
and whole in gradient, so every factor a step puts on the returned loss (1 / micro-batches, fp16 loss scale)
reaches it too, and the logged loss stays comparable with a run without MTP.

Sequences keep their length (Megatron-Core's way): t_{i+k} and t_{i+k+1} are read from the labels (the tokens
shifted by one: labels_i = t_{i+1}), shifted left by k-1 and k; the k positions at the end that have no target
get label -100 (ignored) and token 0. Positions are those of the main model, and causal attention keeps each
position from seeing the filler after it, so the shapes, sequence-parallel shards and pipeline messages are the
main model's. Everything comes from the labels, which is why the last pipeline stage can run it (it receives
labels, not tokens) and why rows whose labels are not the shifted tokens (chat data's -100s) are refused. The
filler positions take part in what an MTP block's MoE layer counts over all its tokens (the load-balancing loss,
the expert load behind the aux-loss-free bias), as in Megatron-Core; the cross-entropy never sees them.
"""

from __future__ import annotations

import torch
from torch import nn

from megaloom.models.layers import make_norm, norm_input


def mtp_tokens_and_targets(labels: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For depth ``k`` (1-based): the tokens t_{i+k} to embed [B, T] and the targets t_{i+k+1} (-100 past the end)."""
    t = labels.shape[1]
    tokens = torch.zeros_like(labels)
    tokens[:, :t - k + 1] = labels[:, k - 1:].clamp(min=0)
    targets = torch.full_like(labels, -100)
    targets[:, :t - k] = labels[:, k:]
    return tokens, targets


class MTPModule(nn.Module):
    """One depth: the two input norms, the projection of their concatenation, a block and the head's norm."""

    def __init__(self, norm: str, d_model: int, eps: float, block: nn.Module):
        super().__init__()
        self.enorm = make_norm(norm, d_model, eps)
        self.hnorm = make_norm(norm, d_model, eps)
        self.eh_proj = nn.Linear(2 * d_model, d_model, bias=False)
        self.block = block
        self.norm = make_norm(norm, d_model, eps)

    def forward(self, h: torch.Tensor, emb: torch.Tensor, rope, docs=None) -> torch.Tensor:
        """The next depth's states from this one's input states ``h`` and the shifted tokens' embeddings."""
        x = torch.cat([self.enorm(norm_input(emb, self.enorm)), self.hnorm(norm_input(h, self.hnorm))], dim=-1)
        return self.block(self.eh_proj(x), rope, None, 0, docs)
