"""What the ranks of the data-parallel world run for 1-bit Adam / LAMB (megaloom/optim/onebit.py): numbers, checked by
test_dp_world4.py.

The reference is `simulate`: one process playing every data-parallel worker of the same algorithm, written
here from the papers (Tang et al. 2021; Li et al. 2021) without megaloom's optimizer or exchange: each worker's
own gradient on its rows, the warm-up's averaged gradient and plain Adam / LAMB, then per bucket the worker
momenta (times the frozen preconditioner 1 / (sqrt(v_hat) + eps)) with their errors, one scale per piece of a
parameter in each server's chunk, the servers' average with their errors, and the frozen-variance update (frozen
trust ratio times the clamped factor for LAMB). The bucket
layout is `plan_buckets`' (a pure function), padded to 8 x the workers.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import shutil
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from megaloom.checkpoint.store import load_checkpoint, save_checkpoint
from megaloom.data.objective import inputs_and_labels, objective_kwargs
from megaloom.optim.compressed import ChunkPlan, CompressedAverage
from megaloom.optim.onebit import COEFF_BETA, FACTOR_MAX, FACTOR_MIN, FACTOR_THRESHOLD, PAD_MULTIPLE, OnebitOptimizer
from megaloom.optim.param_groups import param_groups
from megaloom.optim.zero import build_data_parallel
from megaloom.parallel import comm
from megaloom.parallel.data_parallel import plan_buckets
from megaloom.parallel.mesh import Mesh
from megaloom.parallel.tensor import gather_full_tensor, parallelize_tensor, sync_tp_grads

from .dp_worlds import BETAS, BUCKET_MB, EPS, GLOBAL_BATCH, LR, WD, base_model, global_batches, run_steps

WARMUP = 4  # of the 10 steps: 6 compressed
WINDOW = 0.5  # train.onebit_variance_window: the frozen variance is the mean g^2 of the warm-up's last 2 steps
WINDOW_STEPS = 2
REFRESH = 2  # train.onebit_variance_updates of the refresh case: the variance updated at steps 6 and 8 (1-based)
BOUND = max(1.0, (1 - BETAS[0]) / math.sqrt(1 - BETAS[1]))  # Adam's per-element step bound (onebit.step_bound)


# ----------------------------------------------------------------------------------------------- simulation


def _segments(offsets: list[int], ends: list[int], padded: int, workers: int) -> list[tuple[int, int]]:
    """(start, end) of every piece of a parameter (or of the padding) inside a server's chunk."""
    chunk = padded // workers
    cuts = sorted({0, *offsets, *(e for e in ends if e < padded), *range(chunk, padded, chunk)})
    return list(zip(cuts, cuts[1:] + [padded], strict=True))


def _one_bit(x: torch.Tensor, segments: list[tuple[int, int]], base: int = 0) -> torch.Tensor:
    """scale * sign(x) per segment (scale: the segment's root mean square; sign(0) = +1)."""
    out = torch.empty_like(x)
    for a, b in segments:
        s = x[a - base:b - base].norm() / math.sqrt(b - a)
        out[a - base:b - base] = torch.where(x[a - base:b - base] >= 0, s, -s)
    return out


class SignTally:
    """Where the simulation's sign decisions stand against the ranks' (`Simulation.step` given their bits).

    The two compute every value from the same inputs (each step starts from the ranks' state) but in their own
    order of float32 operations, so a value may differ from the ranks' by its rounding: ``bound``, at most
    ROUNDINGS roundings of the magnitudes it is made of (each rounding moves a result by at most eps32 / 2 of
    its magnitude), plus, for the server, what the workers' scales may differ by. Within the bound the sign is
    the arithmetic's, not the algorithm's: the simulation takes the ranks' (``near``; ``flips``: where they
    differ); beyond it the signs must agree (``mismatches``: a defect)."""

    def __init__(self) -> None:
        self.decisions = self.near = self.flips = self.mismatches = 0

    def decide(self, x: torch.Tensor, real: torch.Tensor | None, bound: torch.Tensor | None) -> torch.Tensor:
        own = x >= 0
        if real is None:
            return own
        close = x.abs() <= bound  # (zero with a zero bound: padding, an element without gradient)
        self.decisions += x.numel()
        self.near += int((close & (bound > 0)).sum())
        self.flips += int((close & (own != real)).sum())
        self.mismatches += int((~close & (own != real)).sum())
        return torch.where(close, real, own)


EPS32 = torch.finfo(torch.float32).eps  # 2 u: one rounding moves a result by at most EPS32 / 2 of its magnitude
ROUNDINGS = 16  # generous: a worker's value takes ~8 roundings (D's four, the momentum's three, the error's one)


def _one_bit_against(x: torch.Tensor, segments: list[tuple[int, int]], base: int, real: torch.Tensor | None,
                     bound: torch.Tensor | None, tally: SignTally) -> tuple[torch.Tensor, torch.Tensor]:
    """`_one_bit` with the signs decided by ``tally`` against the ranks' ``real`` ones; also returns, per
    element, how far the ranks' scale of its segment may be from this one: the rounding of a sum of L squares
    in any order (at most (L - 1) u relative; the square root halves it, the division adds u) and the segment's
    values' own bound (the norm moves by at most the largest)."""
    out, scale_err = torch.empty_like(x), torch.empty_like(x)
    for a, b in segments:
        seg = slice(a - base, b - base)
        s = x[seg].norm() / math.sqrt(b - a)
        sign = tally.decide(x[seg], None if real is None else real[seg], None if bound is None else bound[seg])
        out[seg] = torch.where(sign, s, -s)
        scale_err[seg] = s * (b - a + 2) * EPS32 + (0.0 if bound is None else bound[seg].max())
    return out, scale_err


def refresh_steps(updates: int, upto: int) -> set[int]:
    """0/1 Adam's variance steps (1-based), as DeepSpeed's ZeroOneAdam counts them step by step: a step updates the
    variance where it is a multiple of the interval, which doubles after every ``updates`` updates."""
    steps, interval, count = set(), 1, 0
    for t in range(1, upto + 1):
        if updates and t % interval == 0:
            steps.add(t)
            count += 1
            if count == updates:
                count, interval = 0, interval * 2
    return steps


class Simulation:
    """``workers`` data-parallel replicas of one model, simulated in this process (tensor parallelism, if any, is
    real: ``mesh`` is a tp-only mesh)."""

    def __init__(self, base, mesh: Mesh, workers: int, kind: str, clip: float, sp: bool = False,
                 refresh: int = 0) -> None:
        self.model = parallelize_tensor(copy.deepcopy(base), mesh, sp)
        self.refreshes = refresh_steps(refresh, 1000)
        self.mesh, self.n, self.kind, self.clip = mesh, workers, kind, clip
        self.groups = param_groups(self.model, WD)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        numel = max(1, int(BUCKET_MB * 2**20) // 4)
        self.buckets = []  # (params, offsets, padded)
        for idx, offs, padded in plan_buckets([p.numel() for p in self.params], numel, workers * PAD_MULTIPLE):
            ps = [self.params[i] for i in idx]
            ends = [o + p.numel() for p, o in zip(ps, offs, strict=True)]
            self.buckets.append((ps, offs, padded, _segments(offs, ends, padded, workers)))
        self.m = {p: torch.zeros_like(p) for p in self.params}
        self.v = {p: torch.zeros_like(p) for p in self.params}
        self.fresh = {p: torch.zeros_like(p) for p in self.params}
        self.sq = {p: torch.zeros_like(p) for p in self.params}  # the variance window's sum of g^2
        self.coeff = {p: [0.0, 0.0] for p in self.params}  # trust ratios' average: numerator, weight
        self.last = {p: 1.0 for p in self.params}
        self.worker_err = [[torch.zeros(b[2]) for b in self.buckets] for _ in range(workers)]
        self.server_err = [torch.zeros(b[2]) for b in self.buckets]  # every server's chunk, side by side
        self.t = 0
        self.tally = SignTally()

    def flat(self, values: dict) -> list[torch.Tensor]:
        """Per-parameter tensors laid out as the buckets (padding zero)."""
        out = []
        for ps, offs, padded, _ in self.buckets:
            flat = torch.zeros(padded)
            for p, o in zip(ps, offs, strict=True):
                flat[o:o + p.numel()] = values[p].reshape(-1)
            out.append(flat)
        return out

    @torch.no_grad()
    def load(self, model, opt: OnebitOptimizer, group) -> None:
        """Take the ranks' state (between two steps): weights, momentum, variances, LAMB's averaged trust ratios
        and last factors, and the errors of the exchange (every worker's, every server's chunk: gathered over
        the data-parallel ``group``), so the next step starts where the ranks' does."""
        mine = dict(model.named_parameters())
        for name, p in self.model.named_parameters():
            q = mine[name]
            st = opt.state[q]
            p.copy_(q)
            self.m[p], self.v[p] = st["exp_avg"].clone(), st["exp_avg_sq"].clone()
            if self.kind == "onebit_lamb":
                self.fresh[p] = st["exp_avg_sq_fresh"].clone()
                self.coeff[p] = [st["lamb_coeff"].item(), st["lamb_coeff_weight"].item()]
                self.last[p] = st["last_factor"].item()
        self.t = opt.steps
        for k, ex in enumerate(opt.exchanges):
            workers = torch.empty(self.n * ex.plan.numel)
            comm.all_gather_into(workers, ex.worker_error, group)
            workers = workers.view(self.n, -1)
            for w in range(self.n):
                self.worker_err[w][k] = workers[w].clone()
            comm.all_gather_into(self.server_err[k], ex.server_error, group)

    def local_grads(self, rows: torch.Tensor, micro: int) -> tuple[list[torch.Tensor], float]:
        n_micro = rows.shape[0] // micro
        total = 0.0
        for i in range(n_micro):
            chunk = rows[i * micro:(i + 1) * micro]
            loss = self.model(*inputs_and_labels(chunk), **objective_kwargs(chunk)) / n_micro
            loss.backward()
            total += loss.item()
        if self.mesh.tp > 1:
            sync_tp_grads(self.model, self.mesh)
        flats = []
        for ps, offs, padded, _ in self.buckets:
            flat = torch.zeros(padded)
            for p, o in zip(ps, offs, strict=True):
                flat[o:o + p.numel()] = p.grad.reshape(-1)
            flats.append(flat)
        for p in self.params:
            p.grad = None
        return flats, total

    def norm(self, flats: list[torch.Tensor]) -> torch.Tensor:
        """The whole gradient's norm (tp-sharded pieces counted once: tensor parallelism is only run unclipped)."""
        return torch.cat(flats).norm()

    def step(self, batch: torch.Tensor, micro: int, real: tuple | None = None) -> float:
        """One step of every worker. ``real``: the ranks' sign bits of this step, (per worker, per bucket: the
        worker's; per bucket: the servers'), taken where a value is within its rounding bound of zero
        (`SignTally`)."""
        local = batch.shape[0] // self.n
        per_worker = [self.local_grads(batch[w * local:(w + 1) * local], micro) for w in range(self.n)]
        grads = [g for g, _ in per_worker]
        loss = sum(total for _, total in per_worker) / self.n
        b1, b2 = BETAS
        self.t += 1
        if self.t <= WARMUP or self.t in self.refreshes:  # all-reduced gradient
            avg = [sum(g[k] / self.n for g in grads) for k in range(len(self.buckets))]
            if math.isfinite(self.clip):
                avg = [a * min(1.0, self.clip / (self.norm(avg).item() + 1e-6)) for a in avg]
            g = self._unflatten(avg)
            if self.t > WARMUP:
                self._refresh(g)
                return loss
            for p in self.params:
                self.m[p] = b1 * self.m[p] + (1 - b1) * g[p]
                self.v[p] = b2 * self.v[p] + (1 - b2) * g[p] * g[p]
                if self.t > WARMUP - WINDOW_STEPS:
                    self.sq[p] = self.sq[p] + g[p] * g[p]
            self._warmup_update()
            if self.t == WARMUP:  # frozen: the window's mean g^2 as v_hat = v / (1 - b2^T)
                self.v = {p: self.sq[p] / WINDOW_STEPS * (1 - b2 ** WARMUP) for p in self.params}
                self.fresh = {p: v.clone() for p, v in self.v.items()}
            return loss
        if math.isfinite(self.clip):  # every worker's gradient by one coefficient: the RMS of their norms
            rms = math.sqrt(sum(self.norm(g).item() ** 2 for g in grads) / self.n)
            grads = [[x * min(1.0, self.clip / (rms + 1e-6)) for x in g] for g in grads]
        m_new = {}
        eps = EPS["adamw" if self.kind == "onebit_adam" else "lamb"]
        for k, (ps, offs, padded, segs) in enumerate(self.buckets):
            m, v = torch.zeros(padded), torch.zeros(padded)
            for p, o in zip(ps, offs, strict=True):
                m[o:o + p.numel()] = self.m[p].reshape(-1)
                v[o:o + p.numel()] = self.v[p].reshape(-1)
            d = 1 / ((v / (1 - b2 ** WARMUP)).sqrt() + eps)  # the frozen preconditioner: exchanged is d x
            sent, scale_err = [], []
            lim = BOUND * (1 - b1 ** self.t)
            for w in range(self.n):
                e = self.worker_err[w][k]
                x = ((grads[w][k] * (1 - b1) + b1 * m) * d).clamp(-lim, lim) + e
                # the magnitudes x is made of (clamped: a value beyond the limit on both sides is the limit)
                size = ((grads[w][k].abs() * (1 - b1) + b1 * m.abs()) * d).clamp(max=lim) + e.abs()
                c, err = _one_bit_against(x, segs, 0, None if real is None else real[0][w][k],
                                          ROUNDINGS * EPS32 / 2 * size, self.tally)
                self.worker_err[w][k] = x - c
                sent.append(c)
                scale_err.append(err)
            chunk = padded // self.n
            out = torch.empty(padded)
            for r in range(self.n):
                lo, hi = r * chunk, (r + 1) * chunk
                y = sum(c[lo:hi] for c in sent) / self.n + self.server_err[k][lo:hi]
                size = sum(c[lo:hi].abs() for c in sent) / self.n + self.server_err[k][lo:hi].abs()
                bound = ROUNDINGS * EPS32 / 2 * size + sum(e[lo:hi] for e in scale_err) / self.n
                mine = [(a, b) for a, b in segs if lo <= a < hi]
                out[lo:hi], _ = _one_bit_against(y, mine, lo, None if real is None else real[1][k][lo:hi], bound,
                                                 self.tally)
                self.server_err[k][lo:hi] = y - out[lo:hi]
            out = out / d
            for p, o in zip(ps, offs, strict=True):
                m_new[p] = out[o:o + p.numel()].view_as(p)
        for p in self.params:
            self.fresh[p] = b2 * self.fresh[p] + (1 - b2) * ((m_new[p] - b1 * self.m[p]) / (1 - b1)) ** 2
            self.m[p] = m_new[p].clone()
        self._compressed_update()
        return loss

    def _refresh(self, g: dict) -> None:
        """0/1 Adam's variance step: exact momentum, v_hat's average kept in the frozen units (v = v_hat (1 -
        b2^T)), every error multiplied by the new preconditioner over the old, then the frozen-variance update."""
        b1, b2 = BETAS
        eps = EPS["adamw"]
        old = [1 / ((v / (1 - b2 ** WARMUP)).sqrt() + eps) for v in self.flat(self.v)]
        for p in self.params:
            self.m[p] = b1 * self.m[p] + (1 - b1) * g[p]
            self.v[p] = b2 * self.v[p] + (1 - b2) * (1 - b2 ** WARMUP) * g[p] * g[p]
        new = [1 / ((v / (1 - b2 ** WARMUP)).sqrt() + eps) for v in self.flat(self.v)]
        for k, (d_old, d_new) in enumerate(zip(old, new, strict=True)):
            for w in range(self.n):
                self.worker_err[w][k] = self.worker_err[w][k] * d_new / d_old
            self.server_err[k] = self.server_err[k] * d_new / d_old
        self._compressed_update()

    def _unflatten(self, flats: list[torch.Tensor]) -> dict:
        out = {}
        for (ps, offs, _, _), flat in zip(self.buckets, flats, strict=True):
            for p, o in zip(ps, offs, strict=True):
                out[p] = flat[o:o + p.numel()].view_as(p)
        return out

    @torch.no_grad()
    def _warmup_update(self) -> None:
        b1, b2 = BETAS
        eps = EPS["adamw" if self.kind == "onebit_adam" else "lamb"]
        for group in self.groups:
            for p in group["params"]:
                u = (self.m[p] / (1 - b1 ** self.t)) / ((self.v[p] / (1 - b2 ** self.t)).sqrt() + eps)
                if self.kind == "onebit_adam":
                    p.mul_(1 - LR * group["weight_decay"]).sub_(LR * u)
                    continue
                u = u + group["weight_decay"] * p
                w, un = p.norm().item(), u.norm().item()
                r = w / un if w > 0 and un > 0 else 1.0
                if r != 1.0:
                    c = self.coeff[p]
                    c[0], c[1] = COEFF_BETA * c[0] + (1 - COEFF_BETA) * r, COEFF_BETA * c[1] + (1 - COEFF_BETA)
                p.sub_(LR * r * u)

    @torch.no_grad()
    def _compressed_update(self) -> None:
        b1, b2 = BETAS
        eps = EPS["adamw" if self.kind == "onebit_adam" else "lamb"]
        for group in self.groups:
            wd = group["weight_decay"]
            for p in group["params"]:
                denom = (self.v[p] / (1 - b2 ** WARMUP)).sqrt() + eps
                prelim = (self.m[p] / (1 - b1 ** self.t)) / denom
                if self.kind == "onebit_adam":
                    p.mul_(1 - LR * wd).sub_(LR * prelim)
                    continue
                update = prelim + wd * p
                factor = (denom / ((self.fresh[p] / (1 - b2 ** self.t)).sqrt() + eps)).max().item()
                if wd:
                    ratio = min(1.0, prelim.norm().item() / update.norm().item())
                    factor = factor * ratio + (1 - ratio)
                factor = min(max(factor, FACTOR_MIN), FACTOR_MAX)
                last = self.last[p]
                factor = min(max(factor, last * (1 - FACTOR_THRESHOLD)), last * (1 + FACTOR_THRESHOLD))
                self.last[p] = factor
                num, weight = self.coeff[p]
                frozen = num / weight if weight > 0 else 1.0
                p.sub_(LR * frozen * factor * update)


# ------------------------------------------------------------------------------------------------- the cases


def build_onebit(base, mesh: Mesh, kind: str, sp: bool = False, bucket_mb: float = BUCKET_MB, refresh: int = 0):
    model = parallelize_tensor(copy.deepcopy(base), mesh, sp)
    grads = build_data_parallel(model, mesh, 0, bucket_mb, pad_multiple=PAD_MULTIPLE)
    opt = OnebitOptimizer(model, grads, "adam" if kind == "onebit_adam" else "lamb", lr=LR, betas=BETAS,
                          eps=EPS["adamw" if kind == "onebit_adam" else "lamb"], weight_decay=WD,
                          warmup_steps=WARMUP, variance_window=WINDOW, variance_updates=refresh)
    return model, grads, opt


class DpLog(comm.OpRecorder):
    """The collectives issued on the data-parallel group, by step."""

    def __init__(self, group) -> None:
        self.group, self.step, self.ops = group, 0, []

    def enter(self, name: str, group, nbytes: int = 0) -> None:
        if group is self.group and not name.startswith("wait "):
            self.ops.append((self.step, name))


class SignBits:
    """The ranks' sign bits of one compressed step, gathered over the data-parallel group: every worker's (each
    exchange's compensated input, recorded as `CompressedAverage.start` leaves it) and every server's (the sign of
    the momentum the exchange produced: m = out / D with D > 0)."""

    def __init__(self, opt: OnebitOptimizer) -> None:
        self.opt = opt
        self.worker: list[torch.Tensor | None] = [None] * len(opt.exchanges)
        for k, ex in enumerate(opt.exchanges):
            def start(x: torch.Tensor, _start=ex.start, _k=k) -> None:
                _start(x)
                self.worker[_k] = (x >= 0).to(torch.uint8)
            ex.start = start

    def gather(self, group, n: int) -> tuple[list[list[torch.Tensor]], list[torch.Tensor]]:
        workers = [[None] * len(self.worker) for _ in range(n)]
        for k, bits in enumerate(self.worker):
            every = torch.empty(n * bits.numel(), dtype=torch.uint8)
            comm.all_gather_into(every, bits, group)
            every = every.view(n, -1)
            for w in range(n):
                workers[w][k] = every[w].bool()
        return workers, [m >= 0 for m in self.opt.m]


def onebit_case(mesh: Mesh, kind: str, clip: float = math.inf, sp: bool = False, bf16: bool = False,
                refresh: int = 0) -> dict:
    """10 steps at this layout against the simulation of ``mesh.dp`` workers (tp, if any, real in both);
    ``bf16``: both under bf16 autocast, as `train.precision=bf16` runs the model (fp32 weights and gradients);
    ``refresh``: train.onebit_variance_updates (0/1 Adam's variance steps among the compressed ones).

    The warm-up steps run side by side from the same weights. Each compressed step the simulation starts from the
    ranks' state (`Simulation.load`) and its result is compared with theirs: a 1-bit sign is a discontinuous
    function of its value, so once one element's sign went the other way for a rounding (the ranks all-reduce in
    gloo's order, the simulation in its own), its error feedback, weight and every later gradient would differ,
    and two free runs part by more than any tolerance (seen: 72 elements, up to 5e-3 apart after 6 steps). Step by
    step, the values differ by their rounding alone, and a sign may differ only where the value is within its
    rounding bound of zero (`SignTally`)."""
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)
    base = base_model("llama", mesh)
    micro = GLOBAL_BATCH // mesh.dp // 2
    batches = global_batches()
    tp_only = dataclasses.replace(mesh, dp=1, dp_rank=0, dp_group=None, dp_cp_group=None, edp_group=None,
                                  recorder=comm.NullRecorder())
    sim = Simulation(base, tp_only, mesh.dp, kind, clip, sp, refresh)
    model, grads, opt = build_onebit(base, mesh, kind, sp, refresh=refresh)
    bits = SignBits(opt)
    log = DpLog(mesh.dp_cp_group)
    sim_params = dict(sim.model.named_parameters())
    losses, ref, state_bytes, param_err, momentum_err, error_err = [], [], 0, 0.0, 0.0, 0.0
    for step, batch in enumerate(batches):
        compressing = opt.compressing()
        if step >= WARMUP:  # (a variance refresh too: from the ranks' state, its errors rescaled on both sides)
            sim.load(model, opt, mesh.dp_cp_group)
        log.step = step
        mesh.recorder = log
        try:
            with autocast:
                losses += run_steps(model, grads, opt, mesh, [batch], micro, clip, None)[0]
        finally:
            mesh.recorder = comm.NullRecorder()
        state_bytes = max(state_bytes, opt.state_bytes())  # the peak: the variance window's sums included
        real = bits.gather(mesh.dp_cp_group, mesh.dp) if compressing else None
        with autocast:
            ref.append(sim.step(batch, micro, real))
        with torch.no_grad():
            param_err = max(param_err, max((p - sim_params[n]).abs().max().item()
                                           for n, p in model.named_parameters()))
            if step >= WARMUP:  # the momentum (relative to its bucket's largest) and this rank's errors
                w = mesh.dp_rank
                for k, (m, want) in enumerate(zip(opt.m, sim.flat(sim.m), strict=True)):
                    momentum_err = max(momentum_err, ((m - want).abs().max() / want.abs().max()).item())
                    ex = opt.exchanges[k]
                    chunk = ex.plan.chunk
                    for got, exp in ((ex.worker_error, sim.worker_err[w][k]),
                                     (ex.server_error, sim.server_err[k][w * chunk:(w + 1) * chunk])):
                        error_err = max(error_err, ((got - exp).abs().max() / exp.abs().max()).item())
    # the replicas hold the same weights: this rank's parameters against the other dp ranks'
    mine = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    other = comm.all_reduce(mine.clone(), mesh.dp_cp_group, op="max")
    t = sim.tally
    # what one step's rounding may move the momentum and the errors by, relative to their largest: the scales'
    # (the longest segment's sum of squares) and the values' own bound
    longest = max(b - a for _, _, _, segs in sim.buckets for a, b in segs)
    return dict(loss=losses, ref_loss=ref, param_err=param_err, momentum_err=momentum_err, error_err=error_err,
                rounding=(longest + 2 + ROUNDINGS) * EPS32,
                decisions=t.decisions, near=t.near, flips=t.flips, mismatches=t.mismatches, numel=mine.numel(),
                replica_err=(other - mine).abs().max().item(),
                ops=log.ops, warmup=WARMUP,
                refreshes=sorted(t - 1 for t in sim.refreshes if WARMUP < t <= len(batches)),
                n_buckets=len(grads.buckets), state_bytes=state_bytes,
                tp=mesh.tp, world=mesh.world_size,
                frozen=opt.frozen_trust_ratios().tolist() if kind == "onebit_lamb" else None)


def collective_case(mesh: Mesh, steps: int = 1000) -> dict:
    """The exchange alone over 1,000 steps against a float64 reference. Every rank draws all ranks' inputs from one
    seeded generator (so each knows the exact average); pieces of magnitudes 1e-2 to 1e1 lie side by side, and a
    drift keeps the running sums growing. Per step: the gap between the running sums of outputs and of exact
    averages, in units of each element's magnitude (largest and mean over the elements); every 250 steps the gap
    plus the errors held (the module doc's identity: zero but for float32 rounding); and the same gap for plain
    1-bit compression without error feedback, which grows."""
    n, rank = mesh.dp, mesh.dp_rank
    numel = 8 * n * 96
    bounds = [0, 37, 400, 401, 700, 1000, 1300]  # uneven pieces, a one-element one, pieces across chunks
    plan = ChunkPlan(numel, n, bounds, mesh.device)
    ex = CompressedAverage(plan, mesh.dp_cp_group, mesh.device)
    gen = torch.Generator().manual_seed(5)
    unit = torch.ones(numel, dtype=torch.float64)
    for i, (a, b) in enumerate(zip(bounds, bounds[1:] + [numel], strict=True)):
        unit[a:b] = 10.0 ** (i % 4 - 2)
    drift = torch.randn(numel, generator=gen, dtype=torch.float64) * unit * 0.3
    segs = list(zip(plan.starts, plan.starts[1:] + [numel], strict=True))
    got, want, plain = (torch.zeros(numel, dtype=torch.float64) for _ in range(3))
    max_gap, mean_gap, plain_gap, residuals = [], [], [], []
    for t in range(steps):
        x = torch.randn(n, numel, generator=gen, dtype=torch.float64) * unit + drift
        want += x.mean(0)
        out = ex(x[rank].float().clone())
        got += out.double()
        gap = (got - want).abs() / unit
        max_gap.append(gap.max().item())
        mean_gap.append(gap.mean().item())
        # no error feedback: each worker's and the server's plain 1-bit compression
        plain += _one_bit(sum(_one_bit(x[w].float(), segs) for w in range(n)) / n, segs).double()
        plain_gap.append(((plain - want).abs() / unit).mean().item())
        if (t + 1) % 250 == 0:
            held = comm.all_reduce(ex.worker_error.double(), mesh.dp_cp_group) / n
            servers = torch.zeros(numel, dtype=torch.float64)
            servers[rank * plan.chunk:(rank + 1) * plan.chunk] = ex.server_error.double()
            held += comm.all_reduce(servers, mesh.dp_cp_group)
            residuals.append(((got - want + held).abs() / unit).max().item())
    same = comm.all_reduce(out.clone(), mesh.dp_cp_group, op="max")
    return dict(max_gap=max_gap, mean_gap=mean_gap, plain_gap=plain_gap, residuals=residuals, steps=steps,
                replicas_equal=bool(torch.equal(same, out)))


def bytes_case(mesh: Mesh) -> dict:
    """Bytes the data-parallel group moves per step, AdamW (zero 0) against 1-bit Adam after its warm-up, with the
    default bucket size (the recorder: buffer bytes, and bytes each rank sends)."""
    from megaloom.parallel.data_parallel import DEFAULT_BUCKET_MB

    from .dp_worlds import make_parallel

    base = base_model("llama", mesh)
    micro = GLOBAL_BATCH // mesh.dp // 2
    batches = global_batches()
    out: dict = {}
    for kind in ("adamw", "onebit_adam"):
        if kind == "adamw":
            model, grads, opt = make_parallel(base, mesh, 0, "adamw")
        else:
            model, grads, opt = build_onebit(base, mesh, kind, bucket_mb=DEFAULT_BUCKET_MB)
        run_steps(model, grads, opt, mesh, batches[:WARMUP], micro, 1.0, None)
        tally = comm.CommTally({mesh.dp_cp_group: "dp"})
        mesh.recorder = tally
        try:
            run_steps(model, grads, opt, mesh, batches[WARMUP:WARMUP + 3], micro, 1.0, None)
        finally:
            mesh.recorder = comm.NullRecorder()
        buf, sent = tally.group_bytes("dp")  # (run_steps' own loss all-reduce passes no recorder)
        out[kind] = dict(rows=tally.rows(), bytes=buf / 3, sent=sent / 3)
    out["numel"] = sum(p.numel() for p in model.parameters())
    return out


def resume_case(mesh: Mesh, kind: str, elsewhere: Mesh) -> dict:
    """6 steps, a checkpoint (save_checkpoint / load_checkpoint: what a run writes), a fresh model, optimizer and
    buckets loaded from it, 4 more steps: against 10 uninterrupted steps; the same with the loaded errors cleared,
    which must differ (the errors are what makes the resume exact); and the checkpoint loaded at another
    data-parallel size (``elsewhere``, tp2 x dp2): the step and momentum load, the errors start at zero."""
    base = base_model("llama", mesh)
    micro = GLOBAL_BATCH // mesh.dp // 2
    batches = global_batches()
    model, grads, opt = build_onebit(base, mesh, kind)
    whole = run_steps(model, grads, opt, mesh, batches, micro, 0.05, None)[0]
    root = _shared_dir(mesh)
    model, grads, opt = build_onebit(base, mesh, kind)
    first = run_steps(model, grads, opt, mesh, batches[:6], micro, 0.05, None)[0]
    momentum = {n: opt.state[p]["exp_avg"].clone() for n, p in model.named_parameters()}
    path = save_checkpoint(Path(root), 6, model, opt, {}, keep=2, rank=mesh.rank, barrier=dist.barrier, mesh=mesh)
    out = dict(whole=whole, first=first)
    for name, clear in (("resumed", False), ("cleared", True)):
        model, grads, opt = build_onebit(base, mesh, kind)
        load_checkpoint(path, model, opt, rank=mesh.rank, mesh=mesh)
        out[f"{name}_steps"] = opt.steps
        out[f"{name}_worker_err"] = max(ex.worker_error.abs().max().item() for ex in opt.exchanges if ex)
        if clear:
            for ex in opt.exchanges:
                if ex is not None:
                    ex.reset()
        out[name] = run_steps(model, grads, opt, mesh, batches[6:], micro, 0.05, None)[0]
    # inside the variance window (warm-up steps 3-4): its sums are in the checkpoint, the resume exact
    model, grads, opt = build_onebit(base, mesh, kind)
    run_steps(model, grads, opt, mesh, batches[:3], micro, 0.05, None)
    sums = {n: opt.state[p]["exp_avg_sq_window"].clone() for n, p in model.named_parameters()}
    early = save_checkpoint(Path(root) / "window", 3, model, opt, {}, keep=1, rank=mesh.rank, barrier=dist.barrier,
                            mesh=mesh)
    model, grads, opt = build_onebit(base, mesh, kind)
    load_checkpoint(early, model, opt, rank=mesh.rank, mesh=mesh)
    out["window_held"] = len(opt.window)
    out["window"] = run_steps(model, grads, opt, mesh, batches[3:], micro, 0.05, None)[0]
    out["window_after"] = len(opt.window) + sum("exp_avg_sq_window" in opt.state[p] for p in opt.params)
    model, grads, opt = build_onebit(base_model("llama", elsewhere), elsewhere, kind)
    load_checkpoint(early, model, opt, rank=mesh.rank, mesh=elsewhere)
    out["window_elsewhere_err"] = max(
        (gather_full_tensor(opt.state[p]["exp_avg_sq_window"], p, elsewhere) - sums[n]).abs().max().item()
        for n, p in model.named_parameters())
    model, grads, opt = build_onebit(base_model("llama", elsewhere), elsewhere, kind)
    for ex in opt.exchanges:  # what a run in progress would hold: the load must clear it
        if ex is not None:
            ex.worker_error.fill_(1.0)
            ex.server_error.fill_(1.0)
    load_checkpoint(path, model, opt, rank=mesh.rank, mesh=elsewhere)
    out["elsewhere_steps"] = opt.steps
    out["elsewhere_errors"] = max(max(ex.worker_error.abs().max().item(), ex.server_error.abs().max().item())
                                  for ex in opt.exchanges if ex)
    out["elsewhere_momentum_err"] = max(
        (gather_full_tensor(opt.state[p]["exp_avg"], p, elsewhere) - momentum[n]).abs().max().item()
        for n, p in model.named_parameters())
    dist.barrier()
    if mesh.rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    return out


def _shared_dir(mesh: Mesh) -> str:
    """A temporary directory made by rank 0, its name given to every rank."""
    name = [tempfile.mkdtemp(prefix="megaloom-onebit-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(name, src=0)
    return name[0]
