"""The global gradient norm of any layout, by one rule: each element of the full model counts once.

A rank's squared norms are weighted by 1 / (the ranks of the reduction that hold the same element), then summed
over the reduction's groups. Which ranks hold copies follows from the tensor's `Layout` and the `Mesh` alone:

- over tp: a tensor split along ``tp_dim`` has no copies; one replicated on every tp rank has tp of them; a
  replicated KV head (``tp_replicas``) has that many;
- over pp: stages hold different layers, except the last stage's copy of an embedding tied to the head
  (``tied_copy``), which is left out (the first stage counts it);
- over data parallelism: with ZeRO (``over_dp``) each data-parallel rank holds a disjoint piece of every gradient,
  so the sum runs over dp x cp too, without weights; otherwise the gradients are replicated there and only expert
  parallelism splits anything: stacked experts differ across the ep ranks, and a dense tensor has ep copies.

So the reduction is tp, pp and either dp x cp (ZeRO) or ep, and nothing in it names a layout's special case: a new
parallel dimension adds its copies to `copy_weight` and its group to `norm_groups`, here and nowhere else.
The weights go to the device once per tensor list (``constants``), not every step; no host synchronisation.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megaloom.parallel import comm
from megaloom.parallel.layout import layout_of
from megaloom.parallel.mesh import Mesh


def copy_weight(t: object, mesh: Mesh, over_dp: bool = False) -> float:
    """1 / (copies of ``t``'s elements among the ranks `norm_groups` sums over); ``t`` a parameter or a view with a
    layout."""
    layout = layout_of(t)
    w = layout.norm_weight(mesh.tp)
    if not over_dp and mesh.ep > 1 and not layout.expert:
        w /= mesh.ep
    return w


def norm_groups(mesh: Mesh, over_dp: bool = False) -> list[comm.Group]:
    """The groups a weighted sum of squares is all-reduced over, in order (a group of one rank is skipped)."""
    if over_dp:
        return [mesh.tp_group, mesh.pp_group, mesh.dp_cp_group]
    return [mesh.ep_group if mesh.ep > 1 else None, mesh.tp_group, mesh.pp_group]


class DeviceConstants:
    """Small constant tensors a step needs (per-tensor norm weights, index maps), made from Python values once per
    device on first use and reused: a tensor made from a list on the GPU is a host-to-device copy that waits for
    the host, every step it is remade. ``made`` counts the tensors made (the tests read it)."""

    def __init__(self) -> None:
        self._cache: dict[tuple[str, torch.device], torch.Tensor] = {}
        self.made = 0

    def get(self, key: str, device: torch.device, build) -> torch.Tensor:
        t = self._cache.get((key, device))
        if t is None:
            t = self._cache[(key, device)] = build().to(device)
            self.made += 1
        return t


def global_grad_norm(tensors: Sequence, mesh: Mesh, over_dp: bool = False,
                     constants: DeviceConstants | None = None) -> torch.Tensor:
    """L2 norm of the full model's gradient from this rank's pieces: ``tensors`` are parameters (or gradient views)
    with a ``.grad`` (None: skipped) and a layout. ``over_dp``: the pieces are ZeRO shards (disjoint across the
    data-parallel group). ``constants``: where the caller keeps the weights between steps (keyed by the tensors
    counted, so a tensor without a gradient this step makes a second entry rather than wrong weights)."""
    total = torch.zeros((), dtype=torch.float32, device=mesh.device)
    counted = [t for t in tensors if t.grad is not None and not layout_of(t).tied_copy]
    if counted:
        norms = torch.stack(torch._foreach_norm([t.grad.float() for t in counted]))
        weights = (constants or DeviceConstants()).get(
            f"norm_weights:{hash(tuple(map(id, counted)))}", norms.device,
            lambda: torch.tensor([copy_weight(t, mesh, over_dp) for t in counted], dtype=torch.float32))
        total += (norms.float().pow(2) * weights).sum().to(total.device)
    for group in norm_groups(mesh, over_dp):
        if group is not None:
            comm.all_reduce(total, group, recorder=mesh.recorder)
    return total.sqrt()
