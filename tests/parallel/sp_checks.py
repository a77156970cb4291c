"""What the ranks measure for the sequence-parallel linears (megaloom/parallel/sp_linear.py) and for the bytes
the tp group moves per step by precision: numbers only, asserted by test_world2.py / test_world4.py."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from megaloom.parallel import comm
from megaloom.parallel.mesh import Mesh
from megaloom.parallel.sp_linear import gathered_linears


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


class _Events(comm.OpRecorder, TorchDispatchMode):
    """One list of what happened, in order: collectives (issue and wait, from the recorder) and GEMMs (from
    the dispatcher)."""

    def __init__(self) -> None:
        TorchDispatchMode.__init__(self)
        self.seen: list[str] = []

    def enter(self, name: str, group, nbytes: int = 0) -> None:
        self.seen.append(name)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.split(".")[0] in ("mm", "addmm", "addmm_"):
            self.seen.append("gemm")
        return func(*args, **(kwargs or {}))


def check_gathered_linears(mesh: Mesh) -> dict:
    """The region node against F.linear on the gathered sequence: outputs, the shard's gradient, weight and
    bias gradients (one output unused in a second case), and the order of its backward's collectives and
    GEMMs (the re-gather in flight under the grad-input GEMMs, the reduce-scatter under the weight GEMMs)."""
    g, size, r, dev = mesh.tp_group, mesh.tp, mesh.tp_rank, mesh.device
    gen = torch.Generator().manual_seed(5)
    errs: dict[str, float] = {}
    events = _Events()
    for batch, used in ((1, 2), (2, 1)):
        t_local, d, outs = 3, 8, (6, 4)
        x = torch.randn(batch, t_local * size, d, generator=gen).to(dev)  # the same on every rank
        ws = [torch.randn(size, o, d, generator=gen).to(dev) for o in outs]  # ws[i][k]: rank k's rows
        bs = [torch.randn(size, o, generator=gen).to(dev) for o in outs]
        gys = [torch.randn(size, batch, t_local * size, o, generator=gen).to(dev) for o in outs]
        sl = slice(r * t_local, (r + 1) * t_local)
        xs = x[:, sl].clone().requires_grad_()
        params = [(w[r].clone().requires_grad_(), b[r].clone().requires_grad_()) for w, b in zip(ws, bs, strict=True)]
        ys = gathered_linears(xs, None, params, g, events if batch == 1 else None)
        loss = sum((y * gy[r]).sum() for y, gy in list(zip(ys, gys, strict=True))[:used])
        with events if batch == 1 else contextlib.nullcontext():
            loss.backward()
        for i, (y, (w, b)) in enumerate(zip(ys, params, strict=True)):
            errs[f"fwd{batch}_{i}"] = _err(y, F.linear(x, ws[i][r], bs[i][r]))
            if i < used:
                g2 = gys[i][r].reshape(-1, outs[i])
                errs[f"dw{batch}_{i}"] = _err(w.grad, g2.t() @ x.reshape(-1, d))
                errs[f"db{batch}_{i}"] = _err(b.grad, g2.sum(0))
            else:
                errs[f"unused{batch}_{i}"] = float(w.grad is not None or b.grad is not None)
        # Every rank's grad-input over the whole sequence, summed; this rank keeps its slice.
        full = sum(gys[i][k] @ ws[i][k] for i in range(used) for k in range(size))
        errs[f"dx{batch}"] = _err(xs.grad, full[:, sl])
    return dict(errs=errs, events=events.seen)


def step_bytes(mesh: Mesh, arch: str, precision: str) -> dict[str, int]:
    """Bytes the tp group moves in one forward + backward + `sync_tp_grads` of a tiny tp+sp model, by op
    (`comm.CommTally`), in fp32 or under bf16 autocast."""
    from megaloom.models import Transformer
    from megaloom.parallel.tensor import parallelize_tensor, sync_tp_grads

    from .worlds import BATCH, SEQ, VOCAB, tiny_config

    cfg = tiny_config(arch, tp=mesh.tp, sp=True, world=mesh.world_size)
    torch.manual_seed(0)
    tally = comm.CommTally({mesh.tp_group: "tp"})
    saved, mesh.recorder = mesh.recorder, tally
    try:
        model = parallelize_tensor(Transformer(cfg.model).to(mesh.device), mesh, sp=True)
        gen = torch.Generator().manual_seed(7)
        batch = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen).to(mesh.device)
        tally.reset()
        auto = (torch.autocast(mesh.device.type, dtype=torch.bfloat16) if precision == "bf16"
                else contextlib.nullcontext())
        with auto:
            loss = model(batch[:, :-1], batch[:, 1:])
        loss.backward()
        sync_tp_grads(model, mesh)
    finally:
        mesh.recorder = saved
    return {op: n for (group, op), n in tally.bytes.items() if group == "tp"}
