"""1-bit Adam's data parallelism simulated in one process (bench/onebit_convergence.py --simulate-dp N): one GPU
plays N data-parallel ranks with megaloom's own optimizer and compression code (issue 51).

Each step, every simulated rank w computes its own gradient on its rows of the global batch (rows [w L, (w+1) L),
L = global / N, as `megaloom train --nproc N` gives rank w), micro-batch by micro-batch, into the one model's
gradient buckets (DataParallelGrads at zero=0 in one process, padded to 8 x N elements as a group of N pads them),
which are then copied aside. Then, as the ranks would:

- warm-up (OnebitOptimizer.steps < train.onebit_warmup_steps): the buckets hold the mean of the N gradients (what
  the all-reduce of pre-divided buckets gives, summed in this order), `DataParallelGrads.clip` clips them and
  `OnebitOptimizer.step()` runs its warm-up branch: the real AdamW, variance window and freeze;
- variance refreshes (train.onebit_variance_updates, 0/1 Adam's policy): as the warm-up, the mean of the N
  gradients clipped, then `OnebitOptimizer.refresh_variance` and the simulated ranks' errors rescaled;
- compressed steps: each rank's gradient is scaled by the one clip coefficient of the root-mean-square of the ranks'
  norms (DataParallelGrads.clip's local rule), each forms its momentum b1 m + (1 - b1) g_w in the frozen
  preconditioner's units, clamped (OnebitOptimizer._exchange_momentum's arithmetic, per rank), and the N
  momenta are averaged bucket by bucket by N `CompressedAverage` objects (megaloom/optim/compressed.py: their
  worker and server errors, sign packing, per-segment scales; only the transport is replaced, by `Loopback`,
  which hands row r of each worker's message to rank r and every server's message to all); then the optimizer's
  own `_adam_update`. Every rank decodes the same momentum, so one model stands for all N replicas.

Checked against the tests' independent dp-N simulation (tests/parallel/dp/onebit_worlds.py, written from the
papers, which test_dp_world4.py checks against a real gloo dp4 world): tests/bench/test_onebit_simulate.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from megaloom.config import TrainConfig
from megaloom.data.objective import inputs_and_labels, objective_kwargs
from megaloom.optim.compressed import ChunkPlan, CompressedAverage
from megaloom.optim.onebit import PAD_MULTIPLE, OnebitOptimizer
from megaloom.optim.zero import build_data_parallel
from megaloom.parallel import comm
from megaloom.parallel.mesh import Mesh


class Loopback:
    """The transport of one bucket's exchange among N simulated ranks: what each posted, handed over on wait."""

    def __init__(self, ranks: int) -> None:
        self.ranks = ranks
        self.sends: dict[int, torch.Tensor] = {}
        self.msgs: dict[int, torch.Tensor] = {}


class LoopbackAverage(CompressedAverage):
    """CompressedAverage of simulated rank ``rank``: the arithmetic is the class's; only the collectives are
    `Loopback`'s (every rank's ``start`` before any ``serve``, every ``serve`` before any ``finish``)."""

    def __init__(self, plan: ChunkPlan, rank: int, hub: Loopback, device: torch.device) -> None:
        self.plan, self.group, self.recorder, self.rank, self.hub = plan, None, None, rank, hub
        self.worker_error = torch.zeros(plan.numel, dtype=torch.float32, device=device)
        self.server_error = torch.zeros(plan.chunk, dtype=torch.float32, device=device)
        self._pending = self._sent = self._got = None

    def _all_to_all(self, got: torch.Tensor, send: torch.Tensor) -> comm.Pending:
        self.hub.sends[self.rank] = send
        hub, me = self.hub, self.rank
        return comm.Pending(then=lambda: got.copy_(torch.stack([hub.sends[w][me] for w in range(hub.ranks)])))

    def _all_gather(self, got: torch.Tensor, msg: torch.Tensor) -> comm.Pending:
        self.hub.msgs[self.rank] = msg
        hub = self.hub
        return comm.Pending(then=lambda: got.copy_(torch.stack([hub.msgs[r] for r in range(hub.ranks)])))


class SimulatedOnebitAdam:
    """1-bit Adam over ``ranks`` simulated data-parallel ranks of ``model`` (on its device, one process)."""

    def __init__(self, model: nn.Module, t: TrainConfig, ranks: int, bucket_mb: float,
                 forward_ctx: Callable[[], object] | None = None) -> None:
        device = next(model.parameters()).device
        self.model, self.n, self.ctx = model, ranks, forward_ctx
        self.grads = build_data_parallel(model, Mesh.single(device), 0, bucket_mb, pad_multiple=PAD_MULTIPLE * ranks)
        self.opt = OnebitOptimizer(model, self.grads, "adam", lr=t.lr, betas=(t.beta1, t.beta2), eps=1e-8,
                                   weight_decay=t.weight_decay, warmup_steps=t.onebit_warmup_steps,
                                   variance_window=t.onebit_variance_window,
                                   variance_updates=t.onebit_variance_updates)
        self.clip = t.grad_clip if t.grad_clip > 0 else math.inf
        self.exchanges = []  # per bucket: the N ranks' exchanges, on one loopback
        for b in self.grads.buckets:
            ends = [o + p.numel() for p, o in zip(b.params, b.offsets, strict=True)]
            plan = ChunkPlan(b.padded, ranks, list(b.offsets) + ends, device)
            hub = Loopback(ranks)
            self.exchanges.append([LoopbackAverage(plan, r, hub, device) for r in range(ranks)])

    @property
    def param_groups(self) -> list[dict]:
        return self.opt.param_groups

    def _rank_gradient(self, rows: torch.Tensor, micro: int) -> tuple[list[torch.Tensor], torch.Tensor]:
        """One rank's gradient (its micro-batches' mean) as copies of the buckets, and its loss. Afterwards every
        ``p.grad`` is its view of the buckets (DataParallelGrads.finish), as on a rank before its step."""
        self.opt.zero_grad()  # no .grad for the backward to add into: the hooks move each gradient to its bucket
        self.grads.zero_grad()
        n_micro = rows.shape[0] // micro
        total = 0.0
        for i in range(n_micro):
            if i == n_micro - 1:
                self.grads.start_last_microbatch()
            chunk = rows[i * micro:(i + 1) * micro]
            with self.ctx() if self.ctx is not None else torch.enable_grad():
                loss = self.model(*inputs_and_labels(chunk), **objective_kwargs(chunk)) / n_micro
            loss.backward()
            total += loss.detach()
        self.grads.finish()
        return [b.data.clone() for b in self.grads.buckets], total

    def step(self, batch: torch.Tensor, micro: int) -> tuple[float, float]:
        """One optimizer step of the N ranks on the global ``batch``; returns (mean loss, gradient norm), read from
        the device once at the end (a read per rank would leave the GPU idle while the host queues the next)."""
        local = batch.shape[0] // self.n
        per_rank = [self._rank_gradient(batch[w * local:(w + 1) * local], micro) for w in range(self.n)]
        flats = [f for f, _ in per_rank]
        loss = sum(total for _, total in per_rank) / self.n
        with torch.no_grad():
            norm = self._update(flats)
        self.opt.zero_grad()
        loss, norm = torch.stack([torch.as_tensor(loss, dtype=torch.float32).reshape(()).to(norm.device),
                                  norm.float().reshape(())]).tolist()
        return loss, norm

    def _update(self, flats: list[list[torch.Tensor]]) -> torch.Tensor:
        if not self.opt.compressing():  # the all-reduced mean, clipped: a warm-up step, or a variance refresh
            for k, b in enumerate(self.grads.buckets):
                b.data.copy_(flats[0][k] / self.n)
                for f in flats[1:]:
                    b.data.add_(f[k] / self.n)
            norm = self.grads.clip(self.clip)
            if self.opt.refreshing():  # OnebitOptimizer.step's refresh branch, on the simulated ranks' errors
                for ratio, exchanges in zip(self.opt.refresh_variance(), self.exchanges, strict=True):
                    for ex in exchanges:
                        ex.rescale(ratio)
                self.opt._adam_update()
                torch._foreach_add_([self.opt.state[p]["step"] for p in self.opt.params], 1.0)
                self.opt.steps += 1
            else:
                self.opt.step()
            return norm
        norm = self._clip_local(flats)
        self._exchange(flats)
        self.opt._adam_update()  # OnebitOptimizer.step's compressed branch after its exchange
        torch._foreach_add_([self.opt.state[p]["step"] for p in self.opt.params], 1.0)
        self.opt.steps += 1
        return norm

    def _clip_local(self, flats: list[list[torch.Tensor]]) -> torch.Tensor:
        """DataParallelGrads.clip's local rule: every rank's gradient by one coefficient, of the RMS of their norms."""
        norms = [torch.nn.utils.get_total_norm(f, foreach=True) for f in flats]
        sq = sum(x.float().pow(2) for x in norms)
        total = (sq / self.n).sqrt()
        if math.isfinite(self.clip):
            coef = torch.clamp(self.clip / (total + 1e-6), max=1.0)
            for f in flats:
                torch._foreach_mul_(f, coef)
        return total

    def _exchange(self, flats: list[list[torch.Tensor]]) -> None:
        """OnebitOptimizer._exchange_momentum for every simulated rank: the momenta averaged into ``m``."""
        opt = self.opt
        b1 = opt.betas[0]
        lim = opt.bound * (1 - b1 ** (opt.steps + 1))
        pre = [opt._preconditioner(v) for v in opt.v]
        for k, m in enumerate(opt.m):
            for w in range(self.n):
                flats[w][k].mul_(1 - b1).add_(m, alpha=b1).mul_(pre[k]).clamp_(-lim, lim)
                self.exchanges[k][w].start(flats[w][k])
        for k in range(len(opt.m)):
            for ex in self.exchanges[k]:
                ex.serve()
        for k, (b, m) in enumerate(zip(self.grads.buckets, opt.m, strict=True)):
            for w, ex in enumerate(self.exchanges[k]):
                ex.finish(flats[w][k])  # every rank decodes the same values
            b.data.copy_(flats[0][k]).div_(pre[k])
            m.copy_(b.data)
