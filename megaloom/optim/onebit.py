"""1-bit Adam and 1-bit LAMB (``train.optimizer=onebit_adam`` / ``onebit_lamb``): data-parallel communication cut
to sign bits after a warm-up, with error feedback (Tang et al. 2021, "1-bit Adam"; Li et al. 2021, "1-bit LAMB";
DeepSpeed's OnebitAdam / OnebitLamb are the reference for behaviour).

Warm-up (the first ``train.onebit_warmup_steps`` steps): plain AdamW (torch's, fused on GPUs) or megaloom's LAMB
on gradients all-reduced by DataParallelGrads' buckets as usual: the same updates as ``adamw`` / ``lamb``.

Compression stage, each step:
- the gradient buckets are not reduced (DataParallelGrads.local): each rank keeps its own gradient g_r; clipping
  scales it by one coefficient on every rank (the norm is the root-mean-square of the ranks' own norms);
- each rank forms its own momentum x_r = b1 m + (1 - b1) g_r in the bucket, and the buckets' momenta are averaged by
  the error-compensated 1-bit exchange (megaloom/optim/compressed.py: worker and server errors, an all-to-all
  then an all-gather of sign bits, one scale per piece of a parameter per chunk), so every rank ends with the same
  momentum m, bucket after bucket (the next bucket is compressed while the last one's bits travel). What is
  exchanged is D x_r, D = 1 / (sqrt(v_hat) + eps) the frozen preconditioner (a fixed diagonal: averaging commutes
  with it), and m = out / D: each piece's scale is then the root mean square of the update it becomes. Compressing
  x_r itself (DeepSpeed) gives an element whose frozen variance is near zero, the embedding row of a token the
  warm-up hardly saw, an update of scale / eps; on the 1.8M-parameter CPU run that diverged (NaN at step ~220 of
  600, clipping off) or, clipped, ended 4.9% above AdamW. DeepSpeed masks known zero rows by hand
  (``exp_avg_mask``); the preconditioned exchange needs no mask;
- Adam: the variance is frozen, w -= lr (m_hat / (sqrt(v_hat) + eps) + wd w) with m_hat = m / (1 - b1^t) and
  v_hat = v / (1 - b2^T) (T = the warm-up steps; the warm-up's own bias correction, kept: DeepSpeed's 1-bit Adam
  has none). What freezes is the mean of g^2 over the warm-up's last ``train.onebit_variance_window`` (a fraction
  of it, 0.5 by default), not Adam's exponential average at its end (DeepSpeed's, ``=0``): with beta2=0.95 that
  average is mostly the last ~20 steps' gradients, a noisy estimate of each element that is then kept for the
  rest of training; an element frozen low steps too far every step after. On the 2,000-step CPU runs
  (docs/parallelism.md) the window about halved the gap to AdamW's loss (+4.8% to +2.7%: not closed);
- LAMB: the variance is frozen too, and so is the trust ratio: each parameter's ratio ||w|| / ||u|| is averaged
  over the warm-up (an exponential average, beta 0.9, of the ratios other than 1, divided by its weight so a short
  warm-up is not biased low: DeepSpeed's is not divided) and frozen; each step scales it by a factor, the largest
  ratio over the parameter of the frozen denominator to a fresh one (a variance that keeps following the momentum's
  reconstructed gradient (m - b1 m_prev) / (1 - b1), started from the frozen one), mixed towards 1 by
  ||m_hat / denom|| / ||u|| when there is weight decay, clamped to [0.5, 1] (DeepSpeed: [0.5, 4]; see FACTOR_MAX)
  and to within 10% of the last factor (DeepSpeed's default). DeepSpeed's "scaling coefficient" (each momentum
  rescaled before one flat scale is taken) is not needed: the exchange's scales are per parameter piece, where
  that rescaling cancels exactly.

Variance refreshes (``train.onebit_variance_updates=N``, 1-bit Adam only; 0, the default, keeps the variance frozen):
0/1 Adam's variance policy (Lu et al. 2022; DeepSpeed's ZeroOneAdam, ``var_update_scaler``). Counting steps from 1,
the variance is updated at every multiple of an interval that starts at 1 and doubles after each N updates (N = 16:
steps 1-16, then every 2nd to 48, every 4th to 112, ... every 64th from 1,088): the warm-up's steps are all exact,
and after it a step on that schedule is run uncompressed (the gradients all-reduced as in the warm-up, clipped by
the global norm): m = b1 m + (1 - b1) g exactly, v_hat = b2 v_hat + (1 - b2) g^2 (kept in the frozen variance's
units, v_hat = v / (1 - b2^T)), the errors of the exchange rescaled by D_new / D_old elementwise (they are held in
the preconditioner's units), then the same update as a compressed step. ~2.6% of 1,700 steps after a 300-step
warm-up are uncompressed at N = 16. Why: on the ~92M model of issue 51 (H100, 2026-12-06) a variance frozen at step
300 left 1-bit Adam 9.5% above AdamW's train loss by step 1,640 (the corpus memorised from step ~700 on, where
AdamW's variance follows the shrinking gradients and the frozen one does not).

Where it runs: parallel.zero=0 (every rank holds the whole momentum and variance: each updates the whole momentum
from its own gradient and applies the same decompressed momentum to all its weights, so ZeRO would have to
all-gather the parameters every step, the traffic this removes: refused in config validation). Compression is
over the data-parallel group (dp x cp) only, each bucket over its own group (expert weights over edp); tp, pp and
ep keep their own collectives. A group of one rank is not compressed (exact momentum, frozen variance).

State: ``exp_avg`` and ``exp_avg_sq`` are AdamW's keys (views into one flat buffer per bucket), so checkpoints keep
AdamW's layout and load across optimizers; 1-bit LAMB adds ``exp_avg_sq_fresh``, ``lamb_coeff``,
``lamb_coeff_weight`` and ``last_factor``. Inside the variance window (only there: allocated at its first step,
freed at the freeze) ``exp_avg_sq_window`` holds the sum of the window's squared gradients, so a checkpoint
written there resumes exactly too (at any data-parallel size: the warm-up's gradients are all-reduced). The
errors of the exchange (per rank: the worker error of every element, the server error of its chunk) are
checkpointed too (megaloom/checkpoint/sharded.py, ``optim_local``), so a resume at the same data-parallel size
continues exactly; at another size they restart at zero (said in a line).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from megaloom import accelerator
from megaloom.config import ConfigError, TrainConfig
from megaloom.observe.log import get_logger
from megaloom.optim.compressed import ChunkPlan, CompressedAverage
from megaloom.optim.lamb import Lamb, tp_norm_sync
from megaloom.optim.param_groups import param_groups
from megaloom.parallel import comm
from megaloom.parallel.data_parallel import DataParallelGrads
from megaloom.parallel.expert import is_expert_param
from megaloom.planning.comm import COMPRESS_BYTES_PER_ELEMENT, variance_refresh  # the planner's, one place

log = get_logger(__name__)

KINDS = {"onebit_adam": "adam", "onebit_lamb": "lamb"}
PAD_MULTIPLE = 8  # buckets padded to 8 x the group size: each chunk is whole bytes of sign bits
# 1-bit LAMB (DeepSpeed's defaults)
COEFF_BETA = 0.9  # the exponential average of the warm-up's trust ratios
# Bounds of the factor on the frozen trust ratio. DeepSpeed allows up to 4; here the factor only shrinks the step.
# Measured (2,000-step CPU run, docs/parallelism.md): with 4 the factor reached it within 60 steps of the freeze for
# nearly every parameter (the fresh variance follows the clipped gradient, and the largest ratio over a parameter's
# elements of a 20-step average is an outlier), the run went unstable and ended 22.9% above LAMB's loss; with 1 it
# trained stably.
FACTOR_MIN, FACTOR_MAX = 0.5, 1.0
FACTOR_THRESHOLD = 0.1  # the factor moves at most 10% a step


def _view(flat: torch.Tensor, offset: int, p: nn.Parameter) -> torch.Tensor:
    """``p``'s place in a flat per-bucket buffer, shaped like ``p``."""
    return flat[offset:offset + p.numel()].view_as(p)


def window_steps(warmup: int, fraction: float) -> int:
    """How many of the warm-up's last steps the frozen variance averages (``train.onebit_variance_window``: a
    fraction of the warm-up; 0: none, the variance freezes as Adam's average left it)."""
    return 0 if fraction <= 0 else max(1, min(warmup, round(fraction * warmup)))


def step_bound(betas: tuple[float, float]) -> float:
    """The most one element's preconditioned momentum D x may be in the compressed stage: Adam's own bound on an
    element's step in units of the learning rate, (1 - b1) / sqrt(1 - b2) or 1, whichever is larger (Kingma & Ba
    2015, section 2.1). Adam keeps to it because its variance grows with the gradient; a frozen one does not. An
    element whose variance was near zero when it froze (a token the last ~1 / (1 - b2) warm-up steps hardly
    touched: with train.beta2=0.95, the last 20) and that later gets a gradient would otherwise step by g / eps,
    and as the largest value of its segment set the segment's 1-bit scale: every element of the segment then moved
    by it. On a 2,000-step CPU run (warm-up 400; docs/parallelism.md) that sent the loss from 4.1 to 12 within 50
    steps, with exact averaging in place of the compression too; bounded, it trains on."""
    b1, b2 = betas
    return max(1.0, (1 - b1) / math.sqrt(1 - b2))


class OnebitOptimizer:
    """1-bit Adam (``kind="adam"``) or 1-bit LAMB (``"lamb"``) over the buckets of ``grads`` (zero=0). Behaves like
    a torch optimizer where the training loop touches one: ``param_groups``, ``state``, ``step()``,
    ``zero_grad()``. Compressing from step ``warmup_steps`` on (0-based: after that many updates)."""

    def __init__(self, model: nn.Module, grads: DataParallelGrads, kind: str = "adam", lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 warmup_steps: int = 100, variance_window: float = 0.5, variance_updates: int = 0) -> None:
        if not isinstance(grads, DataParallelGrads) or grads.zero != 0:
            raise ConfigError("1-bit optimizers keep the whole momentum and variance on every data-parallel rank; "
                              "they need parallel.zero=0.")
        if kind not in ("adam", "lamb"):
            raise ValueError(f"kind {kind!r}: adam or lamb")
        if warmup_steps < 1:
            raise ConfigError(f"train.onebit_warmup_steps={warmup_steps}: the variance is frozen after the warm-up, "
                              "so it needs at least one step; e.g. train.onebit_warmup_steps=100.")
        if variance_updates and kind != "adam":
            raise ConfigError("train.onebit_variance_updates refreshes 1-bit Adam's variance; 1-bit LAMB's frozen "
                              "trust ratios assume a frozen variance. Set train.onebit_variance_updates=0 with "
                              "onebit_lamb.")
        self.grads, self.mesh, self.kind = grads, grads.mesh, kind
        self.refresh_updates = variance_updates
        self.warmup, self.betas, self.eps = warmup_steps, betas, eps
        self.bound = step_bound(betas)
        self.window_steps = window_steps(warmup_steps, variance_window)
        self.window: list[torch.Tensor] = []  # per bucket: the sum of the window's g^2 (only inside the window)
        self._window_from = warmup_steps - self.window_steps  # the step the sums start at
        device = grads.grad_device
        groups = param_groups(model, weight_decay)
        self.params = [p for g in groups for p in g["params"]]
        self.names = {id(p): n for n, p in model.named_parameters()}  # checkpoints name the error buffers
        missing = [n for n, p in model.named_parameters() if p.requires_grad and p not in grads._where]
        if missing:
            raise ValueError(f"parameters outside the gradient buckets: {missing[:3]}")
        buckets = grads.buckets
        zeros = lambda b: torch.zeros(b.padded, dtype=torch.float32, device=device)  # noqa: E731
        self.m = [zeros(b) for b in buckets]
        self.v = [zeros(b) for b in buckets]
        self.fresh = [zeros(b) for b in buckets] if kind == "lamb" else []
        fused = accelerator.fused_optimizer(device) and kind == "adam"
        if kind == "adam":
            self.inner: torch.optim.Optimizer = torch.optim.AdamW(
                groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=fused,
                foreach=None if fused else True)
        else:
            self.inner = Lamb(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                              norm_sync=tp_norm_sync(self.params, self.mesh))
        index = {id(b): i for i, b in enumerate(buckets)}
        step_device = device if fused else torch.device("cpu")
        for p in self.params:
            b, off = grads._where[p]
            i = index[id(b)]
            st = {"step": torch.zeros((), dtype=torch.float32, device=step_device),
                  "exp_avg": _view(self.m[i], off, p), "exp_avg_sq": _view(self.v[i], off, p)}
            if kind == "lamb":
                st.update(exp_avg_sq_fresh=_view(self.fresh[i], off, p),
                          lamb_coeff=torch.zeros((), dtype=torch.float32, device=device),
                          lamb_coeff_weight=torch.zeros((), dtype=torch.float32, device=device),
                          last_factor=torch.ones((), dtype=torch.float32, device=device))
            self.inner.state[p] = st
        # The compressed exchange of each bucket (none for a group of one rank: its momentum is exact).
        self.exchanges: list[CompressedAverage | None] = []
        for b in buckets:
            if b.size == 1:
                self.exchanges.append(None)
                continue
            ends = [o + p.numel() for p, o in zip(b.params, b.offsets, strict=True)]
            plan = ChunkPlan(b.padded, b.size, list(b.offsets) + ends, device)
            self.exchanges.append(CompressedAverage(plan, b.group, device))
        if kind == "lamb":
            self._decay_rows = torch.tensor([g["weight_decay"] > 0 for g in self.inner.param_groups
                                             for _ in g["params"]], device=device)
            experts = [self.mesh.ep > 1 and is_expert_param(p) for p in self.params]
            self._expert_rows = torch.tensor(experts, device=device) if any(experts) else None
        self.steps = 0  # updates taken (host side: no device read to know the stage)
        self._pre_hooks: OrderedDict[int, object] = OrderedDict()  # (a dict a RemovableHandle can refer to)
        grads.local_steps = self.compressing

    # ------------------------------------------------------------------------------- the torch optimizer face

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    @property
    def state(self) -> dict:
        return self.inner.state

    def compressing(self) -> bool:
        """Whether the next step runs the compressed stage (its gradients stay local)."""
        return self.steps >= self.warmup and not self.refreshing()

    def refreshing(self) -> bool:
        """Whether the next step is a variance refresh after the warm-up (train.onebit_variance_updates)."""
        return self.steps >= self.warmup and variance_refresh(self.steps + 1, self.refresh_updates)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    def register_step_pre_hook(self, hook) -> RemovableHandle:
        """``hook(optimizer, args, kwargs)`` before every step, warm-up or compressed (an in-place checkpoint
        write waits there: the compressed step changes the saved state without the inner optimizer's step)."""
        handle = RemovableHandle(self._pre_hooks)
        self._pre_hooks[handle.id] = hook
        return handle

    @torch.no_grad()
    def step(self) -> None:
        for hook in list(self._pre_hooks.values()):
            hook(self, (), {})
        if self.steps < self.warmup:
            self.inner.step()  # the gradients were all-reduced: plain AdamW / LAMB
            if self.steps >= self.warmup - self.window_steps:
                self._add_to_window()
            if self.kind == "lamb":
                self._average_trust_ratios()
            if self.steps + 1 == self.warmup:
                self._freeze_variance()
        else:  # the momentum exchanged in 1 bit, or (a variance step: 1-bit Adam only) all-reduced and exact
            if self.refreshing():
                for ex, ratio in zip(self.exchanges, self.refresh_variance(), strict=True):
                    if ex is not None:
                        ex.rescale(ratio)
            else:
                self._exchange_momentum()
            if self.kind == "adam":
                self._adam_update()
            else:
                self._lamb_update()
            torch._foreach_add_([self.state[p]["step"] for p in self.params], 1.0)
        self.steps += 1

    # ------------------------------------------------------------------------------- the frozen variance

    def _open_window(self) -> None:
        """Allocate the window's sums (zeros) and name them in the state, so checkpoints carry them."""
        self.window = [torch.zeros_like(v) for v in self.v]
        self._window_from = self.steps  # (a resume inside the window from sums-less checkpoint: a shorter one)
        for i, b in enumerate(self.grads.buckets):
            for p, off in zip(b.params, b.offsets, strict=True):
                self.state[p]["exp_avg_sq_window"] = _view(self.window[i], off, p)

    def _close_window(self) -> None:
        for p in self.params:
            self.state[p].pop("exp_avg_sq_window", None)
        self.window = []

    def _add_to_window(self) -> None:
        """Add this warm-up step's squared gradient (all-reduced and clipped: what Adam's variance took) to the
        window's sums; the buckets hold the gradient."""
        if not self.window:
            self._open_window()
        data = [b.data for b in self.grads.buckets]
        torch._foreach_addcmul_(self.window, data, data)

    def _freeze_variance(self) -> None:
        """At the warm-up's end: the variance becomes the window's mean of g^2, scaled so that the update's
        v_hat = v / (1 - b2^T) is that mean; LAMB's fresh variance starts from it."""
        if self.window:
            b2 = self.betas[1]
            count = self.warmup - self._window_from
            torch._foreach_mul_(self.window, (1 - b2 ** self.warmup) / count)
            torch._foreach_copy_(self.v, self.window)
            self._close_window()
        if self.kind == "lamb":
            torch._foreach_copy_(self.fresh, self.v)

    def refresh_variance(self) -> list[torch.Tensor]:
        """A variance refresh's moments from the all-reduced (clipped) gradient in the buckets: m exact, v_hat's
        average in the frozen units; returns per bucket D_new / D_old, which the exchange's errors are rescaled by
        (they are held in the preconditioner's units)."""
        b1, b2 = self.betas
        ratios = []
        for b, m, v in zip(self.grads.buckets, self.m, self.v, strict=True):
            old = self._preconditioner(v)
            m.mul_(b1).add_(b.data, alpha=1 - b1)
            v.mul_(b2).addcmul_(b.data, b.data, value=(1 - b2) * (1 - b2 ** self.warmup))
            ratios.append(self._preconditioner(v).div_(old))
        return ratios

    # ---------------------------------------------------------------------------------- compression stage

    def _exchange_momentum(self) -> None:
        """Every bucket's local momentum x = b1 m + (1 - b1) g averaged by the compressed exchange into ``m``,
        exchanged in the frozen preconditioner's units: D x with D = 1 / (sqrt(v_hat) + eps), then m = out / D.
        The buckets hold this rank's own (clipped) gradient and serve as scratch."""
        b1, b2 = self.betas
        n = self.grads.size
        buckets = self.grads.buckets
        lim = self.bound * (1 - b1 ** (self.steps + 1))  # `step_bound` on the bias-corrected momentum
        for b, m, v, ex in zip(buckets, self.m, self.v, self.exchanges, strict=True):
            # Expert buckets (edp < dp): their gradient is reduced over edp and divided by dp in the plain path.
            b.data.mul_((1 - b1) * b.size / n).add_(m, alpha=b1)
            b.data.mul_(self._preconditioner(v)).clamp_(-lim, lim)
            if ex is not None:
                ex.recorder = self.mesh.recorder
                ex.start(b.data)
        for ex in self.exchanges:
            if ex is not None:
                ex.serve()
        for i, (b, m, v, ex) in enumerate(zip(buckets, self.m, self.v, self.exchanges, strict=True)):
            if ex is not None:
                ex.finish(b.data)
            b.data.div_(self._preconditioner(v))
            if self.kind == "lamb":  # the fresh variance of the gradient the momentum moved by
                m.mul_(-b1).add_(b.data)
                self.fresh[i].mul_(b2).addcmul_(m, m, value=(1 - b2) / (1 - b1) ** 2)
            m.copy_(b.data)

    def _preconditioner(self, v: torch.Tensor) -> torch.Tensor:
        """D = 1 / (sqrt(v / (1 - b2^T)) + eps) of a bucket's frozen variance: what the update multiplies the
        momentum by. The exchange compresses D x, so a piece's one scale is the root mean square of the update it
        becomes: an element whose frozen variance is near zero (the row of a token the warm-up hardly saw) gets
        an update of the size of its piece's, where compressing x itself would send it scale / eps."""
        return (v / (1 - self.betas[1] ** self.warmup)).sqrt_().add_(self.eps).reciprocal_()

    def _adam_update(self) -> None:
        b1, b2 = self.betas
        t = self.steps + 1
        bc1, bc2 = 1 - b1 ** t, 1 - b2 ** self.warmup
        for group in self.param_groups:
            ps = group["params"]
            if not ps:
                continue
            lr, wd = group["lr"], group["weight_decay"]
            if wd:
                torch._foreach_mul_(ps, 1 - lr * wd)
            denom = torch._foreach_sqrt([self.state[p]["exp_avg_sq"] for p in ps])
            torch._foreach_div_(denom, math.sqrt(bc2))
            torch._foreach_add_(denom, self.eps)
            torch._foreach_addcdiv_(ps, [self.state[p]["exp_avg"] for p in ps], denom, -lr / bc1)

    def _lamb_update(self) -> None:
        b1, b2 = self.betas
        t = self.steps + 1
        bc1, bc2_frozen, bc2 = 1 - b1 ** t, 1 - b2 ** self.warmup, 1 - b2 ** t
        rows, partial, largest = [], [], []
        for group in self.param_groups:
            wd = group["weight_decay"]
            for p in group["params"]:
                st = self.state[p]
                denom = (st["exp_avg_sq"] / bc2_frozen).sqrt_().add_(self.eps)
                u = (st["exp_avg"] / bc1).div_(denom)
                fresh = (st["exp_avg_sq_fresh"] / bc2).sqrt_().add_(self.eps)
                largest.append(denom.div_(fresh).max())
                prelim_sq = u.float().pow(2).sum()
                if wd:
                    u.add_(p, alpha=wd)
                partial.append(torch.stack([prelim_sq, u.float().pow(2).sum()]))
                rows.append((group, p, u))
        if not rows:
            return
        sq = torch.stack(partial)
        if self.inner.norm_sync is not None:
            sq = self.inner.norm_sync(sq)  # whole-parameter squares: summed over tp shards and ep
        factor = self._max_over_shards(torch.stack(largest))
        ok = self._decay_rows & (sq[:, 1] > 0)
        mix = torch.where(ok, (sq[:, 0] / sq[:, 1].clamp_min(1e-30)).sqrt().clamp(max=1.0), torch.ones_like(factor))
        factor = (factor * mix + (1 - mix)).clamp(FACTOR_MIN, FACTOR_MAX)
        last = torch.stack([self.state[p]["last_factor"] for p in self.params])
        factor = torch.minimum(torch.maximum(factor, last * (1 - FACTOR_THRESHOLD)), last * (1 + FACTOR_THRESHOLD))
        torch._foreach_copy_([self.state[p]["last_factor"] for p in self.params], list(factor.unbind()))
        coeff = self.frozen_trust_ratios() * factor
        for i, (group, p, u) in enumerate(rows):
            p.add_(u.mul_(coeff[i].to(u.dtype)), alpha=-group["lr"])

    def _max_over_shards(self, x: torch.Tensor) -> torch.Tensor:
        """Per-parameter maxima of tensor-parallel (and expert-parallel) pieces: the maximum over the whole
        parameter (replicated pieces are equal, so taking their maximum changes nothing)."""
        comm.all_reduce(x, self.mesh.tp_group, op="max", recorder=self.mesh.recorder)
        if self._expert_rows is not None:
            over = comm.all_reduce(x.clone(), self.mesh.ep_group, op="max", recorder=self.mesh.recorder)
            x = torch.where(self._expert_rows, over, x)
        return x

    # ---------------------------------------------------------------------------------------- 1-bit LAMB

    def _average_trust_ratios(self) -> None:
        """Fold the warm-up step's trust ratios into their exponential average (ratios of exactly 1, a zero weight
        or update, are left out as DeepSpeed does)."""
        r = self.inner.last_ratios
        if r is None:
            return
        num = [self.state[p]["lamb_coeff"] for p in self.params]
        den = [self.state[p]["lamb_coeff_weight"] for p in self.params]
        seen = r != 1
        new_num = torch.where(seen, COEFF_BETA * torch.stack(num) + (1 - COEFF_BETA) * r, torch.stack(num))
        new_den = torch.where(seen, COEFF_BETA * torch.stack(den) + (1 - COEFF_BETA), torch.stack(den))
        torch._foreach_copy_(num, list(new_num.unbind()))
        torch._foreach_copy_(den, list(new_den.unbind()))

    def frozen_trust_ratios(self) -> torch.Tensor:
        """Each parameter's trust ratio averaged over the warm-up (1 where none was seen)."""
        num = torch.stack([self.state[p]["lamb_coeff"] for p in self.params])
        den = torch.stack([self.state[p]["lamb_coeff_weight"] for p in self.params])
        return torch.where(den > 0, num / den.clamp_min(1e-30), torch.ones_like(num))

    # ---------------------------------------------------------------------------------------- checkpoints

    def error_buffers(self) -> list[tuple[nn.Parameter, int, int, torch.Tensor, tuple[int, torch.Tensor] | None]]:
        """Per parameter in a compressed bucket: (parameter, group size, group rank, its worker error (a view
        shaped like it), (flat start, view) of the server error this rank holds for it, or None)."""
        out = []
        for b, ex in zip(self.grads.buckets, self.exchanges, strict=True):
            if ex is None:
                continue
            lo, hi = b.rank * ex.plan.chunk, (b.rank + 1) * ex.plan.chunk
            for p, off in zip(b.params, b.offsets, strict=True):
                worker = ex.worker_error[off:off + p.numel()].view_as(p)
                a, e = max(lo, off), min(hi, off + p.numel())
                server = (a - off, ex.server_error[a - lo:e - lo]) if e > a else None
                out.append((p, b.size, b.rank, worker, server))
        return out

    def reset_errors(self) -> None:
        """The checkpoint being loaded has no errors for this data-parallel size: start them at zero."""
        for ex in self.exchanges:
            if ex is not None:
                ex.reset()
        if self.compressing() and any(ex is not None for ex in self.exchanges):
            log.info("megaloom: the checkpoint holds no 1-bit error-feedback buffers for this data-parallel size: "
                     "they start at zero (the compression error held at the save is dropped once)")

    def prepare_load(self, saved: set[str]) -> None:
        """Before a checkpoint load (``saved``: the checkpoint's tensor names): hold the variance window's sums
        where the checkpoint has them (written inside the window), none where it does not."""
        if any(k.endswith(".exp_avg_sq_window") for k in saved):
            if not self.window:
                self._open_window()
        else:
            self._close_window()

    def state_loaded(self) -> None:
        """After a checkpoint load: the stage follows the loaded step count."""
        if self.params:
            self.steps = int(self.state[self.params[0]]["step"])
        self._window_from = self.warmup - self.window_steps
        if self.window and not self._window_from < self.steps < self.warmup:
            self._close_window()  # sums from a checkpoint outside this run's window (another window setting)

    def state_bytes(self) -> int:
        """Bytes of optimizer state on this rank: momentum and variance (and LAMB's fresh variance, and inside the
        variance window its sums) of every parameter, padding included, plus the exchange's worker and server
        errors."""
        n = sum(t.numel() for t in self.m + self.v + self.fresh + self.window)
        n += sum(ex.worker_error.numel() + ex.server_error.numel() for ex in self.exchanges if ex is not None)
        return 4 * n


def build_onebit(model: nn.Module, grads: DataParallelGrads, cfg: TrainConfig) -> OnebitOptimizer:
    """``train.optimizer=onebit_adam`` / ``onebit_lamb`` over the gradient buckets ``grads`` (built with
    ``pad_multiple=PAD_MULTIPLE``)."""
    kind = KINDS[cfg.optimizer]
    return OnebitOptimizer(model, grads, kind, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                           eps=1e-8 if kind == "adam" else 1e-6, weight_decay=cfg.weight_decay,
                           warmup_steps=cfg.onebit_warmup_steps, variance_window=cfg.onebit_variance_window,
                           variance_updates=cfg.onebit_variance_updates)


# ----------------------------------------------------------------------------------- when it pays (a model)

@dataclass(frozen=True)
class StepModel:
    """The data-parallel part of one step's time for AdamW against 1-bit Adam after its warm-up, per rank:
    ``params`` (this rank's, fp32 gradients), ``ranks`` in the data-parallel group, ``link_gb_s`` the bandwidth one
    rank gets across the slowest link (GB/s, one direction: a 400 Gb/s NIC per GPU is 50), ``overlap_s`` the
    backward time an all-reduce can hide under (the buckets reduce during the last micro-batch's backward),
    ``hbm_gb_s`` the device memory bandwidth (compression passes), ``alpha_s`` the latency of one message and
    ``buckets`` the number of gradient buckets (each one collective, or two for 1-bit, of ``ranks - 1`` steps).

    AdamW: a ring all-reduce sends 2 (n-1)/n x 4 bytes per parameter, under the backward. 1-bit: an all-to-all and
    an all-gather of sign bits, (n-1)/n x 1/8 byte each per parameter (plus a scale per parameter piece, left out),
    after the backward (the clip coefficient needs every rank's norm first), plus the compression's passes over
    memory. Latency: 2 (n-1) messages per bucket for both."""

    params: float
    ranks: int
    link_gb_s: float
    overlap_s: float = 0.0
    hbm_gb_s: float = 4800.0
    alpha_s: float = 5e-6
    buckets: int = 1

    def _latency(self) -> float:
        return 2 * (self.ranks - 1) * self.alpha_s * self.buckets

    def adamw_bytes(self) -> float:
        return 2 * (self.ranks - 1) / self.ranks * 4 * self.params

    def onebit_bytes(self) -> float:
        return 2 * (self.ranks - 1) / self.ranks * self.params / 8

    def adamw_exposed_s(self) -> float:
        """AdamW's all-reduce time left over after the backward it overlaps."""
        return max(0.0, self.adamw_bytes() / (self.link_gb_s * 1e9) + self._latency() - self.overlap_s)

    def onebit_s(self) -> float:
        """The exchange's time (not overlapped) and its compression passes."""
        return (self.onebit_bytes() / (self.link_gb_s * 1e9) + self._latency()
                + COMPRESS_BYTES_PER_ELEMENT * self.params / (self.hbm_gb_s * 1e9))

    def gain_s(self) -> float:
        """Seconds a 1-bit step saves against an AdamW step (negative: it costs)."""
        return self.adamw_exposed_s() - self.onebit_s()

    def breakeven_gb_s(self) -> float:
        """The link bandwidth below which 1-bit Adam's step is faster (latency left out: it is the same for
        both): 8 P (n-1)/n / B - overlap = P (n-1)/(4n) / B + compression, solved for B."""
        f = (self.ranks - 1) / self.ranks
        compress = COMPRESS_BYTES_PER_ELEMENT * self.params / (self.hbm_gb_s * 1e9)
        return (8 - 0.25) * f * self.params / (self.overlap_s + compress) / 1e9


def run_volume_ratio(warmup_fraction: float, per_step_ratio: float = 32.0) -> float:
    """How many times fewer data-parallel bytes a whole run sends when a fraction of it is the warm-up (full
    AdamW traffic) and the rest sends ``per_step_ratio`` times fewer: 1 / (w + (1 - w) / r)."""
    return 1.0 / (warmup_fraction + (1 - warmup_fraction) / per_step_ratio)
