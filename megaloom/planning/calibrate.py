"""`megaloom doctor --calibrate`: measure this machine's GPU into a calibration file for `megaloom plan`.

What it times (the device's timing events around 8 calls issued back to back, CUDA's on a GPU; the median of
repeats after warm-up, on random data):

- bf16 GEMMs of [S, k] x [k, S] for the smallest dimension k in `GEMM_DIMS` (S = 8192; k = 8192 is the square
  ceiling), as TFLOP/s;
- causal attention through SDPA (cuDNN preferred), forward and backward, at the sequence lengths of `ATTENTION_SEQS`
  and head sizes 64 and 128, as TFLOP/s in the calibration's convention (3.5 x the forward's causal FLOPs);
- the bandwidth of a large device-to-device copy (bytes read and written), TB/s;
- the host time of a tiny kernel's launch, microseconds.

The node and network (GPUs per node, NVLink and NIC bandwidth, latencies) are not measured here: they come from
the options, or from the kind's datasheet file when ``--like`` names one. The device is the machine's accelerator
(`accelerator.default_device`: CUDA on the machines this was built for; another accelerator is timed the same way,
untested). On a machine without one the same code runs on the CPU (wall-clock timing): a smoke test of the command,
not a calibration anyone should plan with.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from megaloom import accelerator
from megaloom.planning.hardware import GPU_DIR, gpu_to_dict, load_gpu

GEMM_DIMS = (128, 256, 512, 1024, 2048, 4096, 8192)
ATTENTION_SEQS = (2048, 4096, 8192, 16384, 32768)


def _sig(x: float) -> float:
    """Three significant figures (a CPU smoke run's rates are far below a GPU's: fixed decimals would round to 0)."""
    return float(f"{x:.3g}")


def _timer(device: torch.device, fn: Callable[[], object], repeats: int, warmup: int = 2, back_to_back: int = 8
           ) -> float:
    """Median seconds of one ``fn`` over ``repeats`` timings, each of ``back_to_back`` calls issued without a
    wait between them, as a training step issues its kernels (one call per timing would measure a GPU that idles
    at every synchronisation)."""
    for _ in range(warmup):
        fn()
    times = []
    streams = accelerator.streams(device)
    for _ in range(repeats):
        if streams is not None:
            start, end = streams.event(timing=True), streams.event(timing=True)
            start.record()
            for _ in range(back_to_back):
                fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / back_to_back)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _dtype(device: torch.device) -> torch.dtype:
    """bf16 on an accelerator (what training runs), fp32 on CPU (a smoke test)."""
    return torch.bfloat16 if accelerator.is_accelerator(device) else torch.float32


def gemm_rates(device: torch.device, size: int = 8192, dims=GEMM_DIMS, repeats: int = 10) -> list[list[float]]:
    dtype = _dtype(device)
    out = []
    for k in dims:
        a = torch.randn(size, k, device=device, dtype=dtype)
        b = torch.randn(k, size, device=device, dtype=dtype)
        s = _timer(device, lambda a=a, b=b: a @ b, repeats)
        out.append([k, _sig(2 * size * size * k / s / 1e12)])
    return out


def attention_rates(device: torch.device, seqs=ATTENTION_SEQS, head_sizes=(64, 128), tokens: int = 32768,
                    repeats: int = 5) -> list[list[float]]:
    dtype = _dtype(device)
    out = []
    for hd in head_sizes:
        heads = 2048 // hd  # d_model 2048 worth of heads
        for s in seqs:
            b = max(1, tokens // s)
            q, k, v = (torch.randn(b, heads, s, hd, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
            grad = torch.randn(b, heads, s, hd, device=device, dtype=dtype)

            def step(q=q, k=k, v=v, grad=grad):
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                torch.autograd.backward(o, grad)

            secs = _timer(device, step, repeats)
            fwd = 2.0 * b * s * s * heads * hd  # causal: half the pairs, QK^T and PV, 2 FLOPs each
            out.append([s, hd, _sig(3.5 * fwd / secs / 1e12)])
    return out


def copy_bandwidth(device: torch.device, nbytes: int = 2 * 2**30, repeats: int = 10) -> float:
    src = torch.empty(nbytes // 4, device=device, dtype=torch.float32).normal_()
    dst = torch.empty_like(src)
    s = _timer(device, lambda: dst.copy_(src), repeats)
    return _sig(2 * nbytes / s / 1e12)


def launch_us(device: torch.device, n: int = 2000) -> float:
    x = torch.zeros(16, device=device)
    accelerator.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(n):
        x.add_(1.0)
    host = time.perf_counter() - t0
    accelerator.synchronize(device)
    return round(1e6 * host / n, 2)


def calibrate(device: torch.device, name: str | None = None, like: str | None = None, quick: bool = False) -> dict:
    """A calibration file's contents for ``device`` (module doc); ``like``: a GPU kind whose node and network
    figures (not measured here) are kept; ``quick``: tiny sizes (tests)."""
    base = gpu_to_dict(load_gpu(like)) if like else {
        "gpus_per_node": 8, "nvlink_gbps": 360.0, "nic_gbps": 50.0, "nvlink_latency_us": 8.0,
        "nic_latency_us": 15.0, "collective_us": 30.0}
    on_device = accelerator.is_accelerator(device)
    size, dims, seqs, tokens, nbytes = ((256, (32, 64, 128), (128, 256), 512, 2**20) if quick
                                        else (8192, GEMM_DIMS, ATTENTION_SEQS, 32768, 2 * 2**30))
    total = accelerator.total_memory(device)
    from megaloom.observe.flops import device_peak_flops

    out = dict(base)
    out.update({
        "name": name or accelerator.device_name(device),
        "source": "measured" if on_device else "measured on CPU (a smoke test, not for planning)",
        "peak_tflops": (device_peak_flops(device) or 0.0) / 1e12 if on_device else base.get("peak_tflops", 1.0),
        "memory_gb": round(total / 1e9, 1) if total is not None else base.get("memory_gb", 1.0),
        "gemm": gemm_rates(device, size, dims, repeats=3 if quick else 10),
        "attention": attention_rates(device, seqs, tokens=tokens, repeats=2 if quick else 5),
        "hbm_tbps": copy_bandwidth(device, nbytes, repeats=3 if quick else 10),
        "launch_us": launch_us(device, 200 if quick else 2000),
        "notes": [f"written by `megaloom doctor --calibrate` on {time.strftime('%Y-%m-%d')}, torch "
                  f"{torch.__version__}; launch_us is the raw launch of a tiny kernel (the planner's own H200 file "
                  "keeps every host cost per kernel of a compiled block instead: docs/planner.md)",
                  "node and network: " + (f"kept from {like}" if like else "defaults, not measured")],
    })
    return out


def calibrate_command(out: str | None, name: str | None, like: str | None, quick: bool = False) -> int:
    device = accelerator.default_device()
    data = calibrate(device, name, like, quick)
    path = Path(out) if out else GPU_DIR / f"{(name or data['name']).lower().replace(' ', '-')}.json"
    path.write_text(json.dumps(data, indent=1) + "\n")
    print(f"calibration of {data['name']} written to {path} (gemm {data['gemm'][-1][1]} TFLOP/s at its largest "
          f"shape, HBM {data['hbm_tbps']} TB/s); plan with: megaloom plan ... --gpu {path}")
    return 0
