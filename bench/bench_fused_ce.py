"""The output head + loss alone: unfused (F.linear, fp32 cross-entropy) vs the fused, chunked version.

One forward + backward of llama3-1b's head (d_model 2048, vocabulary 128,256) over 4 x 4096 tokens under bf16
autocast with fp32 master weights, as in training: median time and the peak memory above the inputs.

    python bench/bench_fused_ce.py [--tokens 16384] [--chunks 1024,2048,4096]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import megaloom.models.fused_ce as fused_ce  # noqa: E402
from megaloom.models.transformer import cross_entropy  # noqa: E402


def measure(fn, x, w, labels, iters: int) -> dict:
    times = []
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    for _ in range(iters):
        x.grad = w.grad = None
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = fn(x, w, labels)
        (loss * 0.5).backward()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() - base
    return {"ms": round(1e3 * statistics.median(times[2:]), 2), "peak_extra_gb": round(peak / 2**30, 2),
            "loss": float(loss), "gx": x.grad.float().norm().item(), "gw": w.grad.norm().item()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--d-model", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--chunks", default="1024,2048,4096")
    ap.add_argument("--iters", type=int, default=8)
    args = ap.parse_args()
    torch.manual_seed(0)
    dev = torch.device("cuda")
    x = torch.randn(args.tokens, args.d_model, device=dev, requires_grad=True)
    w = (torch.randn(args.vocab, args.d_model, device=dev) * 0.02).requires_grad_()
    labels = torch.randint(0, args.vocab, (args.tokens,), device=dev)
    rows = {"unfused": measure(lambda a, b, c: cross_entropy(F.linear(a, b), c), x, w, labels, args.iters)}
    for compiled in (False, True):
        fused_ce.COMPILE_CHUNK = compiled
        for c in [int(v) for v in args.chunks.split(",")]:
            name = f"fused chunk={c} {'compiled' if compiled else 'eager'}"
            rows[name] = measure(lambda a, b, lab, c=c: fused_ce.linear_cross_entropy(a, b, lab, c), x, w, labels,
                                 args.iters)
    for name, r in rows.items():
        print(f"{name:32s} {r['ms']:8.2f} ms  peak +{r['peak_extra_gb']:6.2f} GiB  loss {r['loss']:.6f}  "
              f"|gx| {r['gx']:.6e}  |gw| {r['gw']:.6e}", flush=True)
    print("RESULT " + json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                                  "tokens": args.tokens, "rows": rows}))


if __name__ == "__main__":
    main()
