"""The memory report's prediction against the CUDA allocator's peak, for several configurations on one GPU.

For each configuration: build the model on the GPU as `megaloom train` does on one process (fp32 master
weights, AdamW fused, `TrainStep` under bf16 autocast), predict its peak with
`megaloom.planning.memory_plan.plan_memory`, run a few steps on synthetic tokens, and compare with
``torch.cuda.max_memory_allocated`` (peak bytes since the configuration was built). One JSON line per
configuration; exits 1 when a prediction misses by more than --tolerance percent.

    python bench/bench_memory.py --results $OUT/memory.jsonl          # the default configurations, ~2 minutes
    python bench/bench_memory.py --config "llama3-1b-untied seq=4096 mb=4 recompute=selective"

A configuration is a preset followed by ``seq=``, ``mb=``, ``accum=`` (micro-batches per step),
``recompute=``, ``precision=`` and any ``model.*`` / ``train.*`` overrides.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megaloom.config import load_config  # noqa: E402
from megaloom.models import apply_recompute  # noqa: E402
from megaloom.models.attention_kernel import attention_backend  # noqa: E402
from megaloom.models.transformer import build_on_device  # noqa: E402
from megaloom.optim.build import build_optimizer  # noqa: E402
from megaloom.planning.levers import resolve_levers  # noqa: E402
from megaloom.planning.memory_plan import GB, plan_memory  # noqa: E402
from megaloom.step import TrainStep  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_train import git_commit  # noqa: E402  (one definition of the commit stamp)

DEFAULT_CONFIGS = [
    "llama3-1b-untied seq=4096 mb=2 recompute=none",
    "llama3-1b-untied seq=4096 mb=4 recompute=selective",
    "llama3-1b-untied seq=4096 mb=4 recompute=full",
    "gpt2-124m seq=1024 mb=16 recompute=none",
    "llama3-1b seq=4096 mb=2 accum=2 recompute=selective",
]


def parse(spec: str) -> dict:
    words = spec.split()
    out = {"preset": words[0], "seq": 4096, "mb": 2, "accum": 1, "recompute": "none", "precision": "bf16",
           "overrides": []}
    for w in words[1:]:
        key, _, value = w.partition("=")
        if key in ("seq", "mb", "accum"):
            out[key] = int(value)
        elif key in ("recompute", "precision"):
            out[key] = value
        elif "." in key:
            out["overrides"].append(w)
        else:
            raise SystemExit(f"bench_memory: cannot read {w!r} in {spec!r} (seq=, mb=, accum=, recompute=, "
                             "precision=, model.*=, train.*=)")
    return out


def run_one(spec: str, steps: int, device: torch.device, attention: str) -> dict:
    c = parse(spec)
    gbs = c["mb"] * c["accum"]
    cfg = load_config(None, [f"model.preset={c['preset']}", f"train.seq_len={c['seq']}",
                             f"model.max_seq_len={max(c['seq'], 1024)}", f"train.micro_batch_size={c['mb']}",
                             f"train.global_batch_size={gbs}", f"train.recompute={c['recompute']}",
                             f"train.precision={c['precision']}", f"train.attention={attention}", *c["overrides"]])
    cfg = resolve_levers(cfg, "cuda")[0]  # train.fused_loss "auto" as a GPU run chooses it (the plan does the same)
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)  # whatever a previous configuration left (should be ~0)
    torch.manual_seed(0)
    model = build_on_device(cfg.model, device)
    # As the trainer: selective recompute re-runs the attention core only under the math kernel.
    apply_recompute(model, c["recompute"], core_attention=attention_backend(cfg, "cuda") == "math")
    if getattr(cfg.train, "fused_loss", False) is True:
        from megaloom.models.fused_ce import FusedHeadLoss

        model.loss = FusedHeadLoss()
    optimizer = build_optimizer(model, cfg.train, device)
    step = TrainStep(model, optimizer, c["precision"], device, c["mb"], grad_clip=1.0, attention=attention)
    plan = plan_memory(cfg, model, world_size=1, device="cuda")
    print(plan.table(), flush=True)
    per_step = []
    for i in range(steps):
        batch = torch.randint(0, cfg.model.vocab_size, (gbs, c["seq"] + 1), device=device)
        t0 = time.perf_counter()
        out = step(batch)
        loss = out.loss.item()
        torch.cuda.synchronize(device)
        per_step.append(torch.cuda.max_memory_allocated(device) - base)
        print(f"  step {i + 1}: loss {loss:.3f}, {time.perf_counter() - t0:.2f} s, peak so far "
              f"{per_step[-1] / GB:.2f} GB", flush=True)
    measured = per_step[-1]
    plan.measured_peak = measured
    row = {
        "config": spec, "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name(device), "torch": torch.__version__, "commit": git_commit(),
        "preset": c["preset"], "seq_len": c["seq"], "micro_batch": c["mb"], "grad_accum": c["accum"],
        "recompute": c["recompute"], "precision": c["precision"], "attention": attention,
        "params": plan.setup["params_local"],
        "predicted_peak_gb": round(plan.peak / GB, 3), "measured_peak_gb": round(measured / GB, 3),
        "error_pct": round(plan.error_pct(), 2), "peak_phase": plan.peak_phase,
        "measured_after_step_gb": [round(x / GB, 3) for x in per_step],
        "predicted_phases_gb": {k: round(v / GB, 3) for k, v in plan.phases.items()},
        "predicted_gb": {k: round(getattr(plan, k) / GB, 3) for k in
                         ("weights", "gradients", "optimizer", "activations", "weight_casts", "loss_transient",
                          "step_transient")},
        "reserved_peak_gb": round(torch.cuda.max_memory_reserved(device) / GB, 3),
    }
    print(f"memory: predicted peak {plan.peak / GB:.2f} GB, measured {measured / GB:.2f} GB "
          f"({plan.error_pct():+.1f}%) [{spec}]", flush=True)
    del step, optimizer, model, out
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", action="append", default=None, help="a configuration (repeatable); default: "
                    + "; ".join(DEFAULT_CONFIGS))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--attention", default="auto")
    ap.add_argument("--tolerance", type=float, default=15.0, help="percent; exit 1 if any prediction misses more")
    ap.add_argument("--results", default=None, help="append one JSON line per configuration here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_memory: needs a CUDA GPU (the prediction is compared with the CUDA allocator)")
    device = torch.device("cuda")
    rows = []
    for spec in args.config or DEFAULT_CONFIGS:
        try:
            row = run_one(spec, args.steps, device, args.attention)
        except torch.OutOfMemoryError as e:
            row = {"config": spec, "error": f"out of memory: {e}"[:300]}
            print(f"memory: {spec}: out of memory", flush=True)
        rows.append(row)
        print("RESULT " + json.dumps(row), flush=True)
        if args.results:
            with open(args.results, "a") as f:
                f.write(json.dumps(row) + "\n")
    print(f"\n{'configuration':<58}{'predicted':>10}{'measured':>10}{'error':>8}  peak at")
    bad = 0
    for r in rows:
        if "error" in r:
            bad += 1
            print(f"{r['config']:<58}{'':>10}{'':>10}{'':>8}  {r['error'][:40]}")
            continue
        ok = abs(r["error_pct"]) <= args.tolerance
        bad += not ok
        print(f"{r['config']:<58}{r['predicted_peak_gb']:>8.2f}GB{r['measured_peak_gb']:>8.2f}GB"
              f"{r['error_pct']:>+7.1f}%  {r['peak_phase']}{'' if ok else '  <-- beyond tolerance'}")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
