"""What one metric line holds: the interval's sums, the data-parallel mean, the MoE load fields.

The record's keys and their order are the metrics.jsonl contract (see `Trainer._record`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megaloom.parallel import comm
from megaloom.parallel.mesh import Mesh


@dataclass
class Interval:
    """The steps since the last metric line: loss summed on the device (read once per line), compute seconds."""
    loss_sum: torch.Tensor
    steps: int = 0
    compute_s: float = 0.0
    warmup_s: float = 0.0  # the first step of the process (compilation, allocator warm-up), when in this interval
    images: int = 0  # images this rank's batches held (multimodal models: the encoder's share of MFU)

    def reset(self) -> None:
        self.loss_sum.zero_()
        self.steps, self.compute_s, self.warmup_s, self.images = 0, 0.0, 0.0, 0

    def seconds_per_step(self) -> float:
        """For the ETA: the interval's mean step time without the warm-up step (which would inflate the first
        estimate many times over when compilation is on)."""
        if self.warmup_s and self.steps > 1:
            return (self.compute_s - self.warmup_s) / (self.steps - 1)
        return self.compute_s / max(self.steps, 1)


def dp_mean(x: torch.Tensor, mesh: Mesh) -> float:
    """Mean of a per-rank scalar over the data-parallel replicas (tp/pp peers already agree)."""
    if mesh.dp * mesh.cp > 1:
        x = x.detach().clone().float()
        comm.all_reduce(x, mesh.dp_cp_group, recorder=mesh.recorder)
        x /= mesh.dp * mesh.cp
    return float(x.item())


def moe_fields(moe: list) -> dict:
    """Per MoE layer: the busiest expert's load over the mean (1 = balanced), the tokens per expert, the aux loss
    of the last micro-batch and the dropped share. Empty for a dense model."""
    if not moe:
        return {}
    return {"moe_load_max_over_mean": [round(float(m.last_load.max() / m.last_load.float().mean().clamp(min=1e-9)),
                                             4) for m in moe],
            "moe_tokens_per_expert": [m.last_load.tolist() for m in moe],
            "moe_aux_loss": float(sum(float(m.aux_loss.detach()) for m in moe)),
            "moe_dropped_fraction": float(sum(float(m.last_dropped_fraction) for m in moe) / len(moe))}
