"""The planner's two checks (docs/planner.md), reproducible on any machine (nothing runs on a GPU):

    python bench/planner_checks.py dry-run      # its dry-run prediction vs the H200 dry runs in bench/results.jsonl
    python bench/planner_checks.py megatron     # Narayanan et al. 2021, Table 1, typed in as published
    python bench/planner_checks.py megatron --weight-bytes 12   # with Megatron's per-micro-batch weight traffic
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from megaloom.config import load_config  # noqa: E402
from megaloom.planning import compute  # noqa: E402
from megaloom.planning.hardware import load_gpu  # noqa: E402
from megaloom.planning.memory_fit import resolve_for_planning  # noqa: E402
from megaloom.planning.step import predict  # noqa: E402

# Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM" (SC'21,
# arXiv 2104.04473), Table 1, as transcribed here: parameters (billion), attention heads, hidden size, layers,
# tensor-parallel size, pipeline-parallel size, GPUs (A100 80 GB, Selene), batch size, achieved TFLOP/s per GPU.
# Vocabulary 51,200, sequence 2,048, mixed precision, activation recomputation; their FLOPs count the
# recomputation: 96 B s l h^2 (1 + s / 6h + V / 16 l h) per step.
TABLE_1 = [(1.7, 24, 2304, 24, 1, 1, 32, 512, 137), (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
           (7.5, 32, 4096, 36, 4, 1, 128, 512, 142), (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
           (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138), (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
           (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148), (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
           (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163), (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163)]


def _levers_then(r: dict) -> list[str]:
    """The levers as the row's run chose them: recorded in rows since 2026-12-06 05:00; before, what auto meant on
    that date (the fusion on at auto since 2026-12-06, bf16 weights since the 05:00 call)."""
    if "levers" in r:
        return [f"{k}={str(v).lower()}" for k, v in r["levers"].items()
                if k in ("train.grad_accum_fusion", "train.bf16_params")]
    pinned = [] if r["date"] >= "2026-12-06" else ["train.grad_accum_fusion=false"]
    set_by_hand = {o.split("=")[0] for o in r["overrides"]}
    return [o for o in (*pinned, "train.bf16_params=false") if o.split("=")[0] not in set_by_hand]


def dry_run_check(gpu_name: str = "h200") -> None:
    """Each row against the calibration of its own GPU: ``gpu_name`` for the H200 rows, h100-sxm for the H100's."""
    gpus = {"H200": load_gpu(gpu_name), "H100": load_gpu("h100-sxm")}
    rows = [json.loads(x) for x in (ROOT / "bench" / "results.jsonl").read_text().splitlines() if '"dry_run"' in x]
    seen = set()
    print("| GPU | layout (rank) | levers set | seq | measured step | predicted | error |\n"
          "|---|---|---|---:|---:|---:|---:|")
    for r in rows[::-1]:
        if r.get("step_ms") is None:  # a build-only row (the plan did not fit the GPU)
            continue
        kind = "H100" if "H100" in r.get("gpu", "") else "H200"
        gpu = gpus[kind]
        levers = " ".join(o.removeprefix("train.") for o in r["overrides"] if o.startswith(
            ("train.grad_accum_fusion", "train.bf16_params")))
        key = (kind, r["layout"], r["seq_len"], r["rank"], levers)
        if key in seen:
            continue
        seen.add(key)
        cfg = resolve_for_planning(load_config(None, [*r["overrides"], *_levers_then(r)]))
        from megaloom.parallel.mesh import rank_coords
        from megaloom.preflight import preflight

        pp_rank = rank_coords(r["rank"], preflight(cfg, r["world"]).sizes)["pp"]
        p = predict(cfg, r["world"], gpu, mode="dry-run", memory=False, pp_rank=pp_rank)
        err = 100 * (1e3 * p.step_s - r["step_ms"]) / r["step_ms"]
        print(f"| {kind} | {r['preset']} {r['layout']} ({r['rank']}) | {levers or 'auto'} | {r['seq_len']} | "
              f"{r['step_ms']:.0f} ms | "
              f"{1e3 * p.step_s:.0f} ms | {err:+.1f}% |")


# Megatron-LM 2021 kept fp16 weights with fp32 main gradients accumulated by the weight-gradient GEMM
# (gradient_accumulation_fusion): megaloom's train.bf16_params (every master in the optimizer at zero 0) with
# train.grad_accum_fusion. `--as-megaloom-defaults` leaves both at auto (the fusion on; bf16 weights off at zero 0).
MEGATRON_LEVERS = ["train.bf16_params=true", "train.grad_accum_fusion=true"]


def megatron_check() -> None:
    gpu = load_gpu("a100-80gb")
    print("| model | layout | GPUs | batch | published TFLOP/s/GPU | predicted | error |\n"
          "|---|---|---:|---:|---:|---:|---:|")
    for size, heads, h, layers, tp, pp, n, batch, published in TABLE_1:
        over = ["model.arch=gpt2", f"model.d_model={h}", f"model.n_heads={heads}", f"model.n_kv_heads={heads}",
                f"model.ffn_dim={4 * h}", f"model.n_layers={layers}", "model.vocab_size=51200",
                "model.max_seq_len=2048", "train.seq_len=2048", f"train.global_batch_size={batch}",
                "train.micro_batch_size=1", f"parallel.tp={tp}", f"parallel.pp={pp}", "parallel.sp=false",
                "parallel.zero=0", "train.recompute=full", "train.precision=bf16", *MEGATRON_LEVERS]
        cfg = resolve_for_planning(load_config(None, over))
        p = predict(cfg, n, gpu, memory=False)
        s, v = 2048, 51200
        flops = 96 * batch * s * layers * h * h * (1 + s / (6 * h) + v / (16 * layers * h))
        got = flops / p.step_s / n / 1e12
        print(f"| {size:g}B | tp{tp} pp{pp} | {n} | {batch} | {published} | {got:.0f} | "
              f"{100 * (got - published) / published:+.0f}% |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("check", choices=("dry-run", "megatron"))
    ap.add_argument("--weight-bytes", type=float, default=None,
                    help="bytes moved per weight per micro-batch (planning/compute.py WEIGHT_BYTES)")
    ap.add_argument("--as-megaloom-defaults", action="store_true",
                    help="Table 1's layouts with megaloom's auto levers instead of Megatron's precision layout")
    ap.add_argument("--gpu", default="h200", help="the calibration of the dry-run check (e.g. h200-doctor: the one "
                                                  "`megaloom doctor --calibrate` measured)")
    args = ap.parse_args()
    if args.as_megaloom_defaults:
        MEGATRON_LEVERS.clear()
    if args.weight_bytes is not None:
        compute.WEIGHT_BYTES = args.weight_bytes
    dry_run_check(args.gpu) if args.check == "dry-run" else megatron_check()


if __name__ == "__main__":
    main()
