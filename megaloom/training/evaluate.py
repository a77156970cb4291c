"""Evaluation on the validation split: the batches this rank reads, and the mean loss without or with pipeline."""

from __future__ import annotations

import torch

from megaloom.data.loader import stack_rows
from megaloom.parallel.mesh import Mesh
from megaloom.step import autocast_ctx, model_inputs


def eval_batches(valid_ds, n_batches: int, global_batch: int, local_batch: int, mesh: Mesh,
                 reads_data: bool) -> list[torch.Tensor | None]:
    """This data-parallel rank's rows of each of the first `n_batches` global validation batches (None on the
    pipeline ranks that read no tokens)."""
    return [stack_rows([valid_ds[i * global_batch + mesh.dp_rank * local_batch + j] for j in range(local_batch)])
            if reads_data else None for i in range(n_batches)]


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: list[torch.Tensor], micro: int, precision: str,
             device: torch.device, documents=None, shard=None) -> float:
    model.eval()
    total, n = torch.zeros((), device=device), 0
    for batch in batches:
        for x, y, kwargs in model_inputs(batch.to(device, non_blocking=True), micro, documents, shard):
            with autocast_ctx(precision, device):
                total += model(x, y, **kwargs).float()
            n += 1
    model.train()
    return (total / max(n, 1)).item()


@torch.no_grad()
def evaluate_pipeline(pipe, batches: list[torch.Tensor | None]) -> float:
    losses = [pipe.run(b) for b in batches]  # forward-only schedule; the mean loss arrives on every stage
    return float(torch.stack(losses).mean().item())

