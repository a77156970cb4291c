"""The first step's gradient comparison of the tensor-parallel parity cases (worlds.py, llava_worlds.py): numbers,
not assertions (checks.assert_parity reads them)."""

from __future__ import annotations

import torch
from torch import nn

from megaloom.parallel.grad_norm import global_grad_norm
from megaloom.parallel.mesh import Mesh
from megaloom.parallel.tensor import gather_full_grads


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def first_step_grads(model: nn.Module, ref: nn.Module, mesh: Mesh, raw: dict[str, torch.Tensor]) -> dict:
    """After backward and the tp sync (``raw``: the full gradients as backward left them, before the sync): each
    full gradient against the single-process reference's (max error, max reference, close synced, close raw),
    the gradient names of both, and the global norms."""
    grads = gather_full_grads(model, mesh)
    ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}  # frozen ones have none
    ref_norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in ref_grads.values()]))
    return {"grad_err": {n: (max_err(grads[n], ref_grads[n]), ref_grads[n].abs().max().item(),
                             torch.allclose(grads[n], ref_grads[n], rtol=1e-4, atol=1e-5),
                             torch.allclose(raw[n], ref_grads[n], rtol=1e-4, atol=1e-5))
                         for n in ref_grads},
            "grad_names": (sorted(n for n, g in grads.items() if g is not None), sorted(ref_grads)),
            "norm": (global_grad_norm(list(model.parameters()), mesh).item(), ref_norm.item())}
