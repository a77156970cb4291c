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


def p2p(nbytes: float, link: Link) -> float:
    return link.alpha + nbytes / link.bw
