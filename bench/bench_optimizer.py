"""The optimizer's share of the step against HBM bandwidth: fused AdamW over a preset's parameters, as the
trainer runs it (one tensor per parameter, two weight-decay groups, the clip folded in as ``grad_scale``) and
over one flat fp32 buffer of the same size (what a flat-buffer optimizer would run).

AdamW reads the parameter, gradient and both moments and writes the parameter and both moments: 28 bytes per
fp32 parameter; the clipping norm reads the gradients once more (4 bytes). The floor in the speed issue counts
that traffic at the device's bandwidth, measured here by a device-to-device copy.

    python bench/bench_optimizer.py --preset llama3-1b-untied [--results FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository, as bench_train.py runs it

from megaloom.config import load_config  # noqa: E402
from megaloom.models.transformer import Transformer  # noqa: E402
from megaloom.optim.param_groups import param_groups  # noqa: E402


def timed(fn, reps: int = 10) -> float:
    """Median milliseconds of `fn` on the device (CUDA events), after two untimed calls."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="llama3-1b-untied")
    ap.add_argument("--results", default=None)
    ap.add_argument("--run-id", default=None)
    args = ap.parse_args()
    device = torch.device("cuda")
    cfg = load_config(None, [f"model.preset={args.preset}"])
    with torch.device("meta"):
        shapes = Transformer(cfg.model)
    params = [torch.nn.Parameter(torch.randn(p.shape, device=device) * 0.02) for p in shapes.parameters()]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    n = sum(p.numel() for p in params)
    model = torch.nn.Module()
    model.params = torch.nn.ParameterList(params)
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-4, fused=True)
    scale = torch.tensor(1.25, device=device)

    def step_scaled() -> None:
        opt.grad_scale = scale
        opt.step()
        opt.grad_scale = None

    flat = torch.nn.Parameter(torch.randn(n, device=device) * 0.02)
    flat.grad = torch.randn_like(flat) * 1e-3
    flat_opt = torch.optim.AdamW([flat], lr=1e-4, weight_decay=0.1, fused=True)
    grads = [p.grad for p in params]
    src, dst = torch.empty(n, device=device), torch.empty(n, device=device)
    row = {
        "bench": "optimizer", "run_id": args.run_id, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
        "preset": args.preset, "params": n,
        "adamw_list_ms": timed(opt.step),
        "adamw_list_grad_scale_ms": timed(step_scaled),
        "adamw_flat_ms": timed(flat_opt.step),
        "clip_norm_ms": timed(lambda: torch.nn.utils.get_total_norm(grads, foreach=True)),
        "copy_ms": timed(lambda: dst.copy_(src)),
        "commit": os.environ.get("MEGALOOM_COMMIT", "unknown"),
    }
    copy_tbs = 8 * n / row["copy_ms"] / 1e9  # read + write 4 bytes each
    row["hbm_tb_per_s"] = round(copy_tbs, 3)
    row["adamw_floor_ms"] = round(28 * n / copy_tbs / 1e9, 3)
    for k in ("adamw_list_ms", "adamw_list_grad_scale_ms", "adamw_flat_ms"):
        row[k.replace("_ms", "_tb_per_s")] = round(28 * n / row[k] / 1e9, 3)
    print(json.dumps(row), flush=True)
    if args.results:
        with open(args.results, "a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
