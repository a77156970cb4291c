"""Attention kernels head to head on one GPU: PyTorch's SDPA with cuDNN, with its built-in flash kernel (FA2), and
FlashAttention-4 as train.attention=fa4 calls it (megaloom/fa4.py), forward + backward, causal, bf16, at
llama3-1b's heads (32 query, 8 key/value heads of 64). Prints ms per call, TFLOP/s, and FA4's largest difference
from cuDNN's output and input gradients.

    python bench/fa4_probe.py [--shapes 4x4096,1x16384,1x32768] [--iters 20]"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megaloom.fa4 import check_fa4, fa4_causal_attention  # noqa: E402


def run(backend: SDPBackend | None, q, k, v, grad, iters: int) -> tuple[float, list[torch.Tensor]]:
    def once():  # backend None: FA4
        for t in (q, k, v):
            t.grad = None
        if backend is None:
            out = fa4_causal_attention(q, k, v)
        else:
            with sdpa_kernel([backend]):
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        out.backward(grad)
        return out

    for _ in range(3):
        once()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        out = once()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters, [out.detach(), q.grad.clone(), k.grad.clone(), v.grad.clone()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="4x4096,1x16384,1x32768")
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    dev = torch.device("cuda")
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    inputs, results = {}, {}
    for b, s in shapes:
        g = torch.Generator(device=dev).manual_seed(0)
        q, k, v, grad = (torch.randn(b, h, s, 64, device=dev, dtype=torch.bfloat16, generator=g)
                         for h in (32, 8, 8, 32))
        inputs[(b, s)] = (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), grad)
    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash2", SDPBackend.FLASH_ATTENTION)):
        for shape, (q, k, v, grad) in inputs.items():
            try:
                results[name, shape] = run(backend, q, k, v, grad, args.iters)
            except RuntimeError as e:
                print(f"{name} {shape}: {str(e).splitlines()[0][:200]}")
    check_fa4(dev)
    for shape, (q, k, v, grad) in inputs.items():
        results["fa4", shape] = run(None, q, k, v, grad, args.iters)
    for (b, s) in shapes:
        flops = 3.5 * 4 * b * 32 * s * s * 64 / 2  # fwd + bwd (2.5x fwd), causal halves the square
        line = [f"b{b} s{s}:"]
        for name in ("cudnn", "flash2", "fa4"):
            if (name, (b, s)) in results:
                ms = results[name, (b, s)][0]
                line.append(f"{name} {ms:.2f} ms ({flops / ms / 1e9:.0f} TFLOP/s)")
        if ("cudnn", (b, s)) in results:
            ref, got = results["cudnn", (b, s)][1], results["fa4", (b, s)][1]
            diffs = [float((a.float() - r.float()).abs().max()) for a, r in zip(got, ref, strict=True)]
            line.append("fa4-cudnn max|diff| out/dq/dk/dv " + "/".join(f"{d:.3g}" for d in diffs))
        print("  ".join(line), flush=True)


if __name__ == "__main__":
    main()
