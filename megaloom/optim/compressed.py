"""Error-compensated 1-bit averaging of a flat buffer over a group: the compressed all-reduce of 1-bit Adam and
1-bit LAMB (Tang et al. 2021; Li et al. 2021), in the two phases DeepSpeed's NCCL backend runs it.

Every rank is a worker for the whole buffer and the server of one chunk of it (rank r serves chunk r of ``ranks``
equal chunks):

    worker  x += e_w;  c = s * sign(x) per segment (sign(0) = +1);  e_w = x - c
            all-to-all: chunk r of c to rank r, as sign bits (8 per byte) and the chunk's segment scales
    server  y = (sum over workers of their chunk r) / ranks + e_s;  c_s = s * sign(y);  e_s = y - c_s
            all-gather of c_s (bits and scales)
    every rank decodes every server's chunk: the same values on every rank.

A chunk is cut into segments at the boundaries given (the parameters of a gradient bucket, and the start of its
padding) and each segment gets its own scale s = ||segment|| / sqrt(its length), DeepSpeed's root-mean-square
scale, so the compressed segment has the segment's L2 norm. DeepSpeed takes one scale per flat buffer (1-bit LAMB
then rescales every parameter's momentum to a common size first, its "scaling coefficient"); one per piece of a
parameter does that by construction: a norm weight beside an embedding keeps its own scale. A segment of zeros
(the padding, a parameter without gradient) compresses to exact zeros and its errors stay zero.

Error feedback: the sum of the outputs over steps equals the sum of the exact averages minus the errors held now,
``sum_t out_t = sum_t mean_w x_w,t - mean_w e_w,T - e_s,T`` (the server error of each chunk on its server), so
the compression error does not accumulate (tests/parallel/dp: 1,000 steps against a float64 reference).

Bytes one rank sends per exchange (``numel`` elements over ``ranks``): (ranks-1)/ranks x (numel/8 + 4 x segments)
in each phase, against 2 (ranks-1)/ranks x 4 x numel for a ring all-reduce of fp32: 32x fewer for large segments.
Every collective goes through megaloom.parallel.comm (all-to-all and all-gather, asynchronous): a caller starts
every bucket's worker phase, then serves each, then finishes each, so one bucket's transfers overlap the next
bucket's compression.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from megaloom.parallel import comm

_SHIFTS: dict[torch.device, torch.Tensor] = {}


def _shifts(device: torch.device) -> torch.Tensor:
    t = _SHIFTS.get(device)
    if t is None:
        t = _SHIFTS[device] = torch.tensor([7, 6, 5, 4, 3, 2, 1, 0], dtype=torch.uint8, device=device)
    return t


def pack_signs(bits: torch.Tensor) -> torch.Tensor:
    """bool [n] (n a multiple of 8) -> uint8 [n / 8], element 8k in the highest bit of byte k."""
    return (bits.view(-1, 8).to(torch.uint8) << _shifts(bits.device)).sum(dim=1, dtype=torch.uint8)


def unpack_signs(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [m] -> float32 [8 m] of +1 (bit set) and -1."""
    bits = (packed.unsqueeze(1) >> _shifts(packed.device)) & 1
    return bits.view(-1).to(torch.float32).mul_(2).sub_(1)


class ChunkPlan:
    """How a flat buffer of ``numel`` elements (a multiple of 8 x ``ranks``) is cut: ``ranks`` equal chunks, each
    into segments at ``boundaries`` (element offsets where a new segment starts), one scale per segment.

    A message row (what one worker sends one server, and what a server sends every rank) is the chunk's sign bits
    (``chunk / 8`` bytes) then ``s_max`` float32 scales as bytes (``s_max``: the most segments of any chunk)."""

    def __init__(self, numel: int, ranks: int, boundaries: Sequence[int], device: torch.device) -> None:
        if ranks < 1 or numel % (8 * ranks):
            raise ValueError(f"a compressed buffer of {numel} elements over {ranks} ranks: pad it to a multiple of "
                             f"8 x ranks = {8 * ranks}")
        self.numel, self.ranks, self.chunk = numel, ranks, numel // ranks
        self.chunk8 = self.chunk // 8
        cuts = sorted({0, *(b for b in boundaries if 0 < b < numel), *(r * self.chunk for r in range(ranks))})
        self.starts = cuts
        self.lengths = [e - s for s, e in zip(cuts, cuts[1:] + [numel], strict=True)]
        self.first = [cuts.index(r * self.chunk) for r in range(ranks)]  # each chunk's first segment
        self.count = [b - a for a, b in zip(self.first, self.first[1:] + [len(cuts)], strict=True)]
        self.s_max = max(self.count)
        self.row = self.chunk8 + 4 * self.s_max
        # each chunk's segment starts after its first, relative to the chunk: `expand` numbers the elements by
        # segment with a cumulative sum of ones put at these starts (one parallel pass; torch.repeat_interleave's
        # CUDA kernel fills each segment with one warp: 1-bit Adam's compressed step on a 92M model ran at a third
        # of its warm-up step's rate, H100 2026-12-06)
        self._inner = [torch.tensor([self.starts[i] - r * self.chunk for i in self.segments(r)][1:], dtype=torch.int32,
                                    device=device) for r in range(ranks)]
        self._sqrt_len = torch.tensor([math.sqrt(n) for n in self.lengths], dtype=torch.float32, device=device)
        # where each segment's scale goes in the [ranks, s_max] block of scales
        self._slot = torch.tensor([r * self.s_max + k for r in range(ranks) for k in range(self.count[r])],
                                  dtype=torch.long, device=device)

    def segments(self, r: int) -> range:
        return range(self.first[r], self.first[r] + self.count[r])

    def scales(self, x: torch.Tensor, r: int | None = None) -> torch.Tensor:
        """Root-mean-square of each segment of ``x``: the whole buffer (``r`` None), or chunk ``r`` alone given as
        a tensor of ``chunk`` elements."""
        segs = range(len(self.starts)) if r is None else self.segments(r)
        base = 0 if r is None else r * self.chunk
        views = [x[self.starts[i] - base:self.starts[i] - base + self.lengths[i]] for i in segs]
        norms = torch.stack(torch._foreach_norm(views))
        return norms / self._sqrt_len[segs.start:segs.stop]

    def expand(self, scales: torch.Tensor, r: int) -> torch.Tensor:
        """Chunk ``r``'s segment scales (its ``count[r]`` first values are used) repeated over their elements."""
        starts = torch.zeros(self.chunk, dtype=torch.int32, device=scales.device)
        starts[self._inner[r]] = 1
        segment = starts.cumsum_(0, dtype=torch.int32)  # each element's segment in the chunk
        return scales[:self.count[r]].index_select(0, segment)

    def scale_rows(self, scales: torch.Tensor) -> torch.Tensor:
        """Every segment's scale (whole buffer) laid out as uint8 [ranks, 4 s_max]: row r holds chunk r's."""
        rows = torch.zeros(self.ranks * self.s_max, dtype=torch.float32, device=scales.device)
        rows[self._slot] = scales
        return rows.view(self.ranks, self.s_max).view(torch.uint8)


def _compress(x: torch.Tensor, scales: torch.Tensor, bits: torch.Tensor, plan: ChunkPlan, r: int,
              error: torch.Tensor) -> None:
    """``error = x - scale * sign(x)`` over chunk ``r`` (``x``, ``bits`` and ``error`` given as that chunk)."""
    q = plan.expand(scales, r)
    torch.sub(x, torch.where(bits, q, q.neg()), out=error)


class CompressedAverage:
    """One flat buffer's error-compensated 1-bit average over ``group`` (see the module doc). Holds this rank's
    worker error (the whole buffer) and server error (its chunk). Call `start`, `serve`, `finish` in that order;
    several buffers may be in flight between them."""

    def __init__(self, plan: ChunkPlan, group: comm.Group, device: torch.device,
                 recorder: comm.OpRecorder | None = None) -> None:
        if comm.group_size(group) != plan.ranks:
            raise ValueError(f"plan for {plan.ranks} ranks, group of {comm.group_size(group)}")
        self.plan, self.group, self.recorder = plan, group, recorder
        self.rank = comm.group_rank(group)
        self.worker_error = torch.zeros(plan.numel, dtype=torch.float32, device=device)
        self.server_error = torch.zeros(plan.chunk, dtype=torch.float32, device=device)
        self._pending: comm.Pending | None = None
        self._sent: torch.Tensor | None = None  # the message in flight (the backend reads it until the wait)
        self._got: torch.Tensor | None = None

    def start(self, x: torch.Tensor) -> None:
        """Worker phase on ``x`` (float32 [numel], used as scratch): compensate, compress, update the worker
        error, and issue the all-to-all that hands each server its chunk."""
        p = self.plan
        x.add_(self.worker_error)
        scales = p.scales(x)
        bits = x >= 0
        send = torch.empty(p.ranks, p.row, dtype=torch.uint8, device=x.device)
        send[:, :p.chunk8].copy_(pack_signs(bits).view(p.ranks, p.chunk8))
        send[:, p.chunk8:].copy_(p.scale_rows(scales))
        for r in range(p.ranks):
            lo, hi = r * p.chunk, (r + 1) * p.chunk
            _compress(x[lo:hi], scales[p.first[r]:], bits[lo:hi], p, r, self.worker_error[lo:hi])
        self._sent, self._got = send, torch.empty_like(send)
        self._pending = self._all_to_all(self._got, send)

    def serve(self) -> None:
        """Server phase for this rank's chunk: average the workers' compressed chunks, compensate, compress, update
        the server error, and issue the all-gather of the result."""
        p, me = self.plan, self.rank
        self._pending.wait()
        got, self._sent = self._got, None
        n = p.count[me]
        scales_in = got[:, p.chunk8:p.chunk8 + 4 * n].contiguous().view(torch.float32)  # [ranks, n]
        y = torch.zeros(p.chunk, dtype=torch.float32, device=got.device)
        for w in range(p.ranks):
            y.addcmul_(unpack_signs(got[w, :p.chunk8]), p.expand(scales_in[w], me))
        y.div_(p.ranks).add_(self.server_error)
        scales = p.scales(y, me)
        bits = y >= 0
        _compress(y, scales, bits, p, me, self.server_error)
        msg = torch.zeros(p.row, dtype=torch.uint8, device=got.device)
        msg[:p.chunk8] = pack_signs(bits)
        msg[p.chunk8:p.chunk8 + 4 * n] = scales.view(torch.uint8)
        self._sent, self._got = msg, torch.empty(p.ranks, p.row, dtype=torch.uint8, device=got.device)
        self._pending = self._all_gather(self._got, msg)

    def _all_to_all(self, got: torch.Tensor, send: torch.Tensor) -> comm.Pending:
        """The worker phase's transport: row r of ``send`` to rank r, row w of ``got`` from rank w. A method of its
        own so that a one-process simulation of the ranks (bench/onebit_simulate.py) replaces the transport only,
        never the arithmetic."""
        return comm.all_to_all_single_async(got, send, self.group, self.recorder)

    def _all_gather(self, got: torch.Tensor, msg: torch.Tensor) -> comm.Pending:
        """The server phase's transport: every rank's ``msg`` into row r of ``got`` ([ranks, row])."""
        return comm.all_gather_into_async(got.view(-1), msg, self.group, self.recorder)

    def finish(self, out: torch.Tensor) -> None:
        """Wait for the all-gather and decode every server's chunk into ``out`` (float32 [numel])."""
        p = self.plan
        self._pending.wait()
        got = self._got
        scales = got[:, p.chunk8:].contiguous().view(torch.float32)  # [ranks, s_max]
        for r in range(p.ranks):
            torch.mul(unpack_signs(got[r, :p.chunk8]), p.expand(scales[r], r), out=out[r * p.chunk:(r + 1) * p.chunk])
        self._pending = self._sent = self._got = None

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The whole exchange for one buffer: ``out`` (default ``x``) receives the compressed average."""
        self.start(x)
        self.serve()
        out = x if out is None else out
        self.finish(out)
        return out

    def rescale(self, ratio: torch.Tensor) -> None:
        """The errors re-expressed in new units, ``ratio`` (float32 [numel]) elementwise: 1-bit Adam exchanges its
        momentum times a preconditioner, so a variance refresh changes what an error element means."""
        p = self.plan
        self.worker_error.mul_(ratio)
        self.server_error.mul_(ratio[self.rank * p.chunk:(self.rank + 1) * p.chunk])

    def reset(self) -> None:
        """Forget the errors (a checkpoint written at another data-parallel size has none for this one)."""
        self.worker_error.zero_()
        self.server_error.zero_()
