"""Collectives by an alpha-beta model: the time of one collective over a group, on the links its ranks use.

A group of ``n`` ranks is placed by megaloom's mesh order (parallel/mesh.py: tp varies fastest, then cp, dp and pp
slowest): a group whose ranks are ``stride`` apart in the global order fits in one node when ``stride * n`` is at
most the node's GPU count; otherwise its ring crosses nodes and each step is limited by the NIC (one per GPU,
rail-optimised, as DGX/HGX nodes are built). Ring algorithms, as NCCL uses for large messages:

- all-gather / reduce-scatter of a full buffer of B bytes: (n - 1) steps, each moving B / n:
  t = (n - 1) * (alpha + B / n / bw)
- all-reduce: a reduce-scatter then an all-gather: 2 (n - 1) (alpha + B / n / bw); for small messages over many
  ranks a tree is faster, t = 2 log2(n) (alpha + B / bw) (double binary tree: the min of the two is taken)
- all-to-all (expert dispatch): (n - 1) (alpha + B / n / bw)
- point-to-point (pipeline stages, ring attention): alpha + B / bw
- 1-bit Adam / LAMB's exchange after the warm-up (megaloom/optim/compressed.py): an all-to-all and an
  all-gather of sign bits (P / 8 bytes each for P parameters), not overlapped with the backward (the clip
  coefficient needs every rank's norm first), plus its compression passes over device memory,
  ``COMPRESS_BYTES_PER_ELEMENT`` per parameter. megaloom/optim/onebit.py's StepModel (docs/parallelism.md, "when it
  pays") uses the same two numbers.

- Muon's exchange (megaloom/optim/muon.py, `muon_exchange`): per weight matrix, in the same order on every rank
  and each collective blocking, under ZeRO-1/2 a reduce of the tp-local fp32 update over the data-parallel group
  to its owner and a broadcast back (rooted, pipelined: (n - 1) alpha + B / bw), and over tp a gather of the
  pieces on one rank and a scatter back (as an all-gather: (n - 1) (alpha + B / n / bw)); the owner's
  Newton-Schulz in between (5 iterations, 4 a^2 b + 2 a^3 FLOPs each on the a x b wide orientation, at the
  bf16 peak). Nothing overlaps it: the next matrix starts when this one is back, so every rank waits for every
  matrix's chain (the round-robin owners spread the memory, not the time) - all exposed.

``bw`` is the link's one-way bandwidth that a ring reaches (GpuKind.nvlink_gbps inside a node, nic_gbps across),
``alpha`` its latency. Not modelled: congestion between groups sharing a NIC, SHARP / NVLS in-network reduction,
and hierarchical (intra-node then inter-node) algorithms, which NCCL uses for all-reduces across nodes (here the
slower, flat ring over the NICs: pessimistic for large dp).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megaloom.planning.hardware import GpuKind

# mesh order (parallel/mesh.py DEFAULT_ORDER "pp-dp-cp-tp"): the stride of each dimension's group in global ranks
ORDER = ("tp", "cp", "dp", "pp")


@dataclass(frozen=True)
class Link:
    bw: float  # bytes / s, one way, as a ring reaches it
    alpha: float  # s per step
    inter_node: bool


def strides(sizes: dict[str, int]) -> dict[str, int]:
    out, s = {}, 1
    for dim in ORDER:
        out[dim] = s
        s *= sizes.get(dim, 1)
    return out


def link_of(gpu: GpuKind, sizes: dict[str, int], dim: str, size: int | None = None) -> Link:
    """The link a ``dim`` group's ring runs on (``size``: a sub-group of that many ranks, e.g. ep inside dp)."""
    n = size or sizes.get(dim, 1)
    span = strides(sizes)[dim] * n
    if span <= gpu.gpus_per_node:
        return Link(gpu.nvlink_gbps * 1e9, gpu.nvlink_latency_us * 1e-6, False)
    return Link(gpu.nic_gbps * 1e9, gpu.nic_latency_us * 1e-6, True)


def all_gather(nbytes: float, n: int, link: Link) -> float:
    """A ring all-gather whose gathered output is ``nbytes`` (a reduce-scatter of an ``nbytes`` input alike)."""
    return 0.0 if n <= 1 else (n - 1) * (link.alpha + nbytes / n / link.bw)


reduce_scatter = all_gather


def all_reduce(nbytes: float, n: int, link: Link) -> float:
    if n <= 1:
        return 0.0
    ring = 2 * (n - 1) * (link.alpha + nbytes / n / link.bw)
    tree = 2 * math.log2(n) * (link.alpha + nbytes / link.bw)
    return min(ring, tree)


def all_to_all(nbytes: float, n: int, link: Link) -> float:
    """Each rank sends ``nbytes`` in all, 1/n to each peer (its own share stays)."""
    return 0.0 if n <= 1 else (n - 1) * (link.alpha + nbytes / n / link.bw)


# Memory traffic of the 1-bit exchange per element of a bucket, in bytes, counted from its ops
# (megaloom/optim/compressed.py: the worker's momentum, error and compression passes ~66, the servers'
# unpacking and averaging ~29, every rank's decoding ~29, the copy into the momentum 8). Counted, not measured.
COMPRESS_BYTES_PER_ELEMENT = 130


def onebit_exchange(params: float, n: int, link: Link, hbm_bytes_per_s: float) -> float:
    """Seconds of 1-bit Adam's momentum exchange of ``params`` fp32 elements over ``n`` ranks (module doc)."""
    if n <= 1:
        return 0.0
    bits = params / 8
    return all_to_all(bits, n, link) + all_gather(bits, n, link) + COMPRESS_BYTES_PER_ELEMENT * params / hbm_bytes_per_s


def variance_refresh(step: int, updates: int) -> bool:
    """Whether 1-based step ``step`` updates 1-bit Adam's variance under 0/1 Adam's policy with ``updates`` updates
    per interval (megaloom/optim/onebit.py's module doc): the interval starts at 1 and doubles after every
    ``updates`` updates; a step updates where it is a multiple of the interval in force. A host-side function of the
    step alone (a resume needs no state); here because the step model prices these steps too."""
    if updates <= 0:
        return False
    interval, count, s = 1, 0, 0
    while True:
        s = (s // interval + 1) * interval  # the next multiple of the interval in force
        if s >= step:
            return s == step
        count += 1
        if count == updates:
            count, interval = 0, interval * 2


def refreshed_fraction(warmup: int, steps: int, updates: int) -> float:
    """The share of the steps after 1-bit Adam's warm-up that are variance steps (uncompressed all-reduces)."""
    after = range(warmup + 1, steps + 1)
    return sum(variance_refresh(t, updates) for t in after) / len(after) if len(after) else 0.0


def p2p(nbytes: float, link: Link) -> float:
    return link.alpha + nbytes / link.bw


def rooted(nbytes: float, n: int, link: Link) -> float:
    """A reduce to, or a broadcast from, one rank of an ``nbytes`` buffer: a pipelined chain (NCCL's ring)."""
    return 0.0 if n <= 1 else (n - 1) * link.alpha + nbytes / link.bw


@dataclass(frozen=True)
class MuonMatrix:
    """One parameter Muon updates, as its exchange sees it: ``local`` elements on a tp rank (a stack of experts
    counted whole: one exchange), ``rows`` x ``cols`` one whole matrix (tp undone), ``stack`` matrices in it,
    ``tp_split`` whether tp cuts it (the router and MLA's down-projections are whole on every tp rank), ``expert``
    whether its data-parallel group is edp (dp / ep) rather than dp."""

    local: int
    rows: int
    cols: int
    stack: int = 1
    tp_split: bool = True
    expert: bool = False

    def ns_flops(self, steps: int = 5) -> float:
        a, b = sorted((self.rows, self.cols))
        return self.stack * steps * (4.0 * a * a * b + 2.0 * a ** 3)


def muon_bytes(matrices: list[MuonMatrix], tp: int, dp: int, ep: int, zero: int) -> dict[tuple[str, str], int]:
    """Bytes Muon's exchange records (megaloom.parallel.comm's buffer sizes: a reduce or broadcast its buffer, a
    gather or scatter its whole gathered buffer) per (group, op), summed over the tp x dp ranks of one pipeline
    stage for one step. Under ZeRO the tp gather runs on the owner's dp rank only (one tp group per data-parallel
    group of tp ranks: ep of them for expert stacks); without it on every replica."""
    out: dict[tuple[str, str], int] = {}

    def add(key: tuple[str, str], n: int) -> None:
        out[key] = out.get(key, 0) + n

    for m in matrices:
        group = max(1, dp // ep) if m.expert else dp
        rooted_dp = zero >= 1 and group > 1
        if rooted_dp:
            add(("dp", "reduce"), 4 * m.local * tp * dp)
            add(("dp", "broadcast"), 4 * m.local * tp * dp)
        if m.tp_split and tp > 1:
            ranks = tp * (dp // group if rooted_dp else dp)
            add(("tp", "gather"), 4 * m.local * tp * ranks)
            add(("tp", "scatter"), 4 * m.local * tp * ranks)
    return out


def muon_exchange(matrices: list[MuonMatrix], tp: int, dp: int, ep: int, zero: int, tp_link: Link | None,
                  dp_link: Link | None, edp_link: Link | None, flops_per_s: float) -> tuple[float, float]:
    """(communication, Newton-Schulz) seconds of one step's Muon exchange on every rank of a stage (module doc)."""
    comm_s = ns_s = 0.0
    for m in matrices:
        group, link = (max(1, dp // ep), edp_link) if m.expert else (dp, dp_link)
        if zero >= 1 and group > 1:
            comm_s += 2 * rooted(4 * m.local, group, link)
        if m.tp_split and tp > 1:
            comm_s += 2 * all_gather(4 * m.local * tp, tp, tp_link)
        ns_s += m.ns_flops() / flops_per_s
    return comm_s, ns_s
