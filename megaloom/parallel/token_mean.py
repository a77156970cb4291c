"""The loss of a step as the mean over every target token of the global batch, for data whose targets are masked.

Each micro-batch's loss comes out of the model as the mean over its own targets (labels other than -100). When
every micro-batch has the same number of targets (next-token prediction on packed rows) the mean of those means,
averaged again over the data-parallel ranks, is the global mean. With masked targets (chat data trains only on
the assistant's tokens, BERT on its masked positions, the multimodal model on the text after an image) the counts
differ, and a mean of means weighs a target in a sparse micro-batch more than one in a dense micro-batch: the
objective, and so the trained model, would depend on train.micro_batch_size and on the data-parallel and context-
parallel sizes. Megatron-LM (``--calculate-per-token-loss``) and TorchTitan (its global token count) weigh each
token once; so does megaloom, by scaling micro-batch i's mean by

    w_i = n_i * R / N,      N = the targets of the step summed over every micro-batch and every rank of the group
                            over which gradients are averaged (dp x cp, R ranks, whose averaging divides by R).

Then sum_i w_i * mean_i, averaged over the R ranks, is (sum of every target's loss) / N. N is one scalar
all-reduce per step on the device: no host synchronisation.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megaloom.models.fused_ce import IGNORE_INDEX
from megaloom.parallel import comm


def target_weights(labels: Sequence[torch.Tensor], group: comm.Group = None, ranks: int = 1,
                   recorder=None) -> torch.Tensor:
    """[m] float32 factors, one per micro-batch's labels: ``n_i * ranks / N`` (module docstring). ``group``: the
    ranks whose gradients are averaged (None on one process); ``ranks``: their number."""
    counts = torch.stack([(y != IGNORE_INDEX).sum() for y in labels]).float()
    total = counts.sum()
    if group is not None and ranks > 1:
        comm.all_reduce(total, group, recorder=recorder)
    return counts * ranks / total.clamp(min=1.0)


def weighted(loss: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``loss * weight``, and 0 (with zero gradient) for a micro-batch without targets, whose mean is 0/0."""
    return torch.where(weight > 0, loss * weight, torch.zeros_like(loss))
