"""Cross-entropy over logits split by vocabulary across tp ranks, without ever gathering them.

With a column-parallel output head each rank holds logits [N, V/tp]. Gathering [N, V] would cost tp times
the largest activation of the model, so instead the softmax normaliser is assembled from three small
all-reduces over [N]: the max (for stability), the sum of exponentials and the target's logit, which lives
on exactly one rank. Backward needs no communication: d loss / d logits = softmax - onehot, and both are
known on the local shard. All math is fp32 whatever the logits' dtype.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.autograd import Function

from megaloom.parallel import comm
from megaloom.parallel.comm import Group, OpRecorder
from megaloom.parallel.mesh import Mesh


class _VocabParallelCE(Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, group: Group, recorder: OpRecorder | None,
                ignore_index: int) -> torch.Tensor:
        """logits [N, V_local], labels [N] (global ids) -> per-token loss [N], 0 where ignored."""
        n_local = logits.shape[-1]
        start = comm.group_rank(group) * n_local
        x = logits.float()
        row_max = x.max(dim=-1).values
        comm.all_reduce(row_max, group, op="max", recorder=recorder)
        z = x - row_max.unsqueeze(-1)  # a new tensor: the caller's logits stay intact
        owned = (labels >= start) & (labels < start + n_local)
        local_label = torch.where(owned, labels - start, torch.zeros_like(labels))
        target = z.gather(-1, local_label.unsqueeze(-1)).squeeze(-1) * owned
        exp = z.exp_()
        # One collective for both sums: [2, N].
        sums = comm.all_reduce(torch.stack([exp.sum(dim=-1), target]), group, recorder=recorder)
        sum_exp, target = sums[0], sums[1]
        valid = labels != ignore_index
        loss = (torch.log(sum_exp) - target) * valid
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_label, owned & valid, valid)
        ctx.logits_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        softmax, local_label, owned, valid = ctx.saved_tensors
        g = (grad_loss.float() * valid).unsqueeze(-1)
        grad = softmax * g
        # Subtract the one-hot of the target, only on the rank that owns it.
        grad.scatter_add_(-1, local_label.unsqueeze(-1), -(g * owned.unsqueeze(-1)))
        return grad.to(ctx.logits_dtype), None, None, None, None


def vocab_parallel_cross_entropy(local_logits: torch.Tensor, labels: torch.Tensor, tp_group: Group,
                                 recorder: OpRecorder | None = None,
                                 ignore_index: int = -100) -> torch.Tensor:
    """Mean next-token cross-entropy (fp32) from logits [..., V/tp] split by vocabulary over ``tp_group``
    (rank r holds ids [r*V/tp, (r+1)*V/tp)); labels [...] hold global ids. Equals
    F.cross_entropy(full_logits, labels, ignore_index=ignore_index) on the gathered logits."""
    flat = local_logits.reshape(-1, local_logits.shape[-1])
    labels = labels.reshape(-1)
    per_token = _VocabParallelCE.apply(flat, labels, tp_group, recorder, ignore_index)
    return per_token.sum() / (labels != ignore_index).sum().clamp(min=1)


class VocabParallelLoss(nn.Module):
    """The model's loss slot (``Transformer.loss``) under tensor parallelism: the vocabulary-split head's
    local logits -> the mean loss over the full vocabulary."""

    def __init__(self, mesh: Mesh) -> None:
        super().__init__()
        self.mesh = mesh

    def forward(self, head: nn.Module, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(head(x), labels, self.mesh.tp_group, self.mesh.recorder)


def gather_vocab_logits(local_logits: torch.Tensor, tp_group: Group,
                        recorder: OpRecorder | None = None) -> torch.Tensor:
    """Full logits [..., V] from the shards (for generation and evaluation that need them; no autograd)."""
    return comm.gather_along_dim(local_logits.contiguous(), local_logits.dim() - 1, tp_group, recorder)
