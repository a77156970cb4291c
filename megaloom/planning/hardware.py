"""A GPU kind and the cluster around it: the numbers the time model multiplies by.

A calibration file per GPU kind (`megaloom/planning/gpus/<kind>.json`) holds what the time model reads:

- ``gemm``: bf16 matmul rates, TFLOP/s, by the GEMM's smallest dimension (a GEMM of M x K by K x N is limited by
  min(M, N, K): thin ones do not fill the tensor cores), interpolated in log space;
- ``attention``: fused causal attention (forward + backward) rates, TFLOP/s counted as the causal half of the full
  score and value FLOPs, by sequence length and head size;
- ``hbm_tbps``: the bandwidth memory-bound kernels reach (a large device-to-device copy), TB/s;
- ``launch_us`` / ``collective_us``: host time per kernel launch and per collective call (what the host pays
  before the GPU can start it), microseconds;
- ``memory_gb``, ``peak_tflops`` (the dense bf16 datasheet peak MFU is counted against);
- the node: ``gpus_per_node``, ``nvlink_gbps`` (per GPU, one direction, what a ring reaches), ``nic_gbps`` (per GPU
  across nodes), and ``nvlink_latency_us`` / ``nic_latency_us``;
- ``source``: "measured" (written by `megaloom doctor --calibrate` on the GPU, or assembled from committed
  measurements, which the file names) or "datasheet" (vendor figures and typical achieved fractions; a planner's
  guess until measured).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

from megaloom.config import ConfigError

GPU_DIR = Path(__file__).parent / "gpus"


@dataclass(frozen=True)
class GpuKind:
    name: str
    source: str  # "measured" or "datasheet" (module doc)
    peak_tflops: float  # dense bf16 datasheet peak: the MFU denominator
    memory_gb: float
    gemm: tuple[tuple[int, float], ...]  # (smallest GEMM dimension, TFLOP/s), ascending
    attention: tuple[tuple[int, int, float], ...]  # (sequence length, head size, TFLOP/s causal-counted)
    hbm_tbps: float
    launch_us: float
    collective_us: float
    gpus_per_node: int
    nvlink_gbps: float
    nic_gbps: float
    nvlink_latency_us: float
    nic_latency_us: float
    notes: tuple[str, ...] = field(default_factory=tuple)

    def gemm_tflops(self, m: int, n: int, k: int) -> float:
        """The rate of one GEMM, by its smallest dimension (log-linear between calibration points)."""
        return _interpolate(self.gemm, min(m, n, k))

    def gemm_seconds(self, m: int, n: int, k: int) -> float:
        return 2.0 * m * n * k / (self.gemm_tflops(m, n, k) * 1e12)

    def attention_tflops(self, seq: int, head_dim: int) -> float:
        """Fused causal attention's rate at this length and head size: the nearest calibrated head size,
        interpolated in the length."""
        sizes = sorted({h for _, h, _ in self.attention})
        hd = min(sizes, key=lambda h: abs(math.log(h / head_dim)))
        return _interpolate(tuple((s, r) for s, h, r in self.attention if h == hd), seq)

    def memory_seconds(self, nbytes: float) -> float:
        return nbytes / (self.hbm_tbps * 1e12)


def _interpolate(points: tuple[tuple[int, float], ...], x: float) -> float:
    pts = sorted(points)
    if x <= pts[0][0]:
        return pts[0][1] * (x / pts[0][0]) if x < pts[0][0] else pts[0][1]  # below: proportionally slower
    for (x0, y0), (x1, y1) in zip(pts, pts[1:], strict=False):
        if x <= x1:
            w = math.log(x / x0) / math.log(x1 / x0)
            return y0 + w * (y1 - y0)
    return pts[-1][1]


def gpu_kinds() -> list[str]:
    return sorted(p.stem for p in GPU_DIR.glob("*.json"))


def load_gpu(kind: str) -> GpuKind:
    """The calibration of a GPU kind by name (``h200``, ``h100-sxm``, ``a100-80gb``, ...) or a JSON file's path."""
    path = Path(kind) if kind.endswith(".json") else GPU_DIR / f"{kind.lower()}.json"
    if not path.is_file():
        raise ConfigError(f"--gpu {kind}: no calibration for that GPU kind; known: {', '.join(gpu_kinds())} (or a "
                          "calibration file's path, e.g. one `megaloom doctor --calibrate --out FILE` wrote).")
    return gpu_from_dict(json.loads(path.read_text()))


def gpu_from_dict(d: dict) -> GpuKind:
    return GpuKind(name=d["name"], source=d["source"], peak_tflops=d["peak_tflops"], memory_gb=d["memory_gb"],
                   gemm=tuple((int(m), float(r)) for m, r in d["gemm"]),
                   attention=tuple((int(s), int(h), float(r)) for s, h, r in d["attention"]),
                   hbm_tbps=d["hbm_tbps"], launch_us=d["launch_us"], collective_us=d["collective_us"],
                   gpus_per_node=d["gpus_per_node"], nvlink_gbps=d["nvlink_gbps"], nic_gbps=d["nic_gbps"],
                   nvlink_latency_us=d["nvlink_latency_us"], nic_latency_us=d["nic_latency_us"],
                   notes=tuple(d.get("notes", ())))


def gpu_to_dict(g: GpuKind) -> dict:
    return {"name": g.name, "source": g.source, "peak_tflops": g.peak_tflops, "memory_gb": g.memory_gb,
            "gemm": [list(p) for p in g.gemm], "attention": [list(p) for p in g.attention],
            "hbm_tbps": g.hbm_tbps, "launch_us": g.launch_us, "collective_us": g.collective_us,
            "gpus_per_node": g.gpus_per_node, "nvlink_gbps": g.nvlink_gbps, "nic_gbps": g.nic_gbps,
            "nvlink_latency_us": g.nvlink_latency_us, "nic_latency_us": g.nic_latency_us, "notes": list(g.notes)}


def with_cluster(g: GpuKind, gpus_per_node: int | None = None, nic_gbps: float | None = None) -> GpuKind:
    """The same GPU in another node size or network (``--gpus-per-node``, ``--nic-gbps``)."""
    changes = {}
    if gpus_per_node:
        changes["gpus_per_node"] = gpus_per_node
    if nic_gbps:
        changes["nic_gbps"] = nic_gbps
    return replace(g, **changes) if changes else g
