"""Several GPUs over NCCL (issue 25): `megaloom train` at every layout that fits the machine, as a user runs it.

Parts (each one device call of under 10 minutes; layouts needing more GPUs than the machine has are skipped):

    parity    50 bf16 steps of a ~250M Llama on the embedded corpus (seq 1024, global batch 32) at each layout,
              against the same run on one GPU: first-step loss within 1e-3, final loss within 1% (bf16 noise)
    scaling   llama3-1b-untied, seq 4096, micro-batch 4 per GPU (weak scaling: the global batch grows with dp),
              compiled, fused loss, cuDNN attention: tokens/s and MFU per GPU at 1, 2, 4, 8 GPUs for pure dp,
              ZeRO-1, ZeRO-3 (FSDP2), tp within the node and pp
    cp        llama3-1b-untied at seq 32k and 64k over cp = 2 .. G in both modes (ring, all-to-all): tokens/s and
              MFU per GPU, the long-sequence rows the context-parallel issue hands to this script

Every run is `python -m megaloom train --nproc N ...` (torchrun underneath): the real launcher, mesh, NCCL groups
and data path. Tokens/s and MFU are the medians of metrics.jsonl after the first logged steps (compilation).
Rows are appended to ``--results`` with ``gpus`` and ``layout``; logs land in ``--out``.

    python bench/multi_gpu.py parity [--gpus N] [--out DIR] [--results FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

# name -> (GPUs, overrides); dp is what the world leaves (megaloom's mesh: world = tp x pp x cp x dp)
PARITY = {
    "dp2": (2, []), "dp2-z1": (2, ["parallel.zero=1"]), "dp2-z2": (2, ["parallel.zero=2"]),
    "dp2-z3": (2, ["parallel.zero=3"]), "tp2-sp": (2, ["parallel.tp=2", "parallel.sp=true"]),
    "pp2-1f1b": (2, ["parallel.pp=2", "parallel.schedule=1f1b"]),
    "cp2-ring": (2, ["parallel.cp=2", "parallel.cp_mode=ring"]),
    "cp2-alltoall": (2, ["parallel.cp=2", "parallel.cp_mode=alltoall"]),
    "tp4-sp": (4, ["parallel.tp=4", "parallel.sp=true"]),
    "pp4-interleaved": (4, ["parallel.pp=4", "parallel.vpp=2", "parallel.schedule=interleaved"]),
    "pp2-zb-dp2": (4, ["parallel.pp=2", "parallel.schedule=zb"]),
    "tp2-pp2-dp2-z1": (8, ["parallel.tp=2", "parallel.sp=true", "parallel.pp=2", "parallel.zero=1"]),
    "dp8-z1": (8, ["parallel.zero=1"]), "dp8-z3": (8, ["parallel.zero=3"]),
    "tp8-sp": (8, ["parallel.tp=8", "parallel.sp=true"]),
    "cp2-tp2-dp2": (8, ["parallel.cp=2", "parallel.tp=2", "parallel.sp=true"]),
    "tp2-sp-async": (2, ["parallel.tp=2", "parallel.sp=true", "parallel.async_tp=true"]),
    "tp4-sp-async": (4, ["parallel.tp=4", "parallel.sp=true", "parallel.async_tp=true"]),
}
PARITY_MOE = {  # the MoE preset's own reference (one GPU, same preset)
    "ep2": (2, ["parallel.ep=2"]), "ep4": (4, ["parallel.ep=4"]), "ep8": (8, ["parallel.ep=8"]),
    "tp2-ep2-dp2": (8, ["parallel.tp=2", "parallel.sp=true", "parallel.ep=2"]),
    "ep2-dp4-z3": (4, ["parallel.ep=2", "parallel.zero=3"]),  # experts sharded over edp=2 by their own FSDP2 unit
}
SMALL = ["model.arch=llama", "model.d_model=1024", "model.n_layers=16", "model.n_heads=16", "model.n_kv_heads=8",
         "model.ffn_dim=2816", "model.max_seq_len=1024", "train.seq_len=1024", "train.global_batch_size=32",
         "train.micro_batch_size=4"]
MOE = ["model.preset=mixtral-tiny", "train.seq_len=1024", "model.max_seq_len=1024", "train.global_batch_size=32",
       "train.micro_batch_size=4"]
COMMON = ["train.steps=50", "train.lr=6e-4", "train.min_lr=6e-5", "train.warmup_steps=10", "train.eval_every=0",
          "train.log_every=5", "checkpoint.every=0", "checkpoint.final=false", "run.tensorboard=false",
          "train.precision=bf16"]
FAST = ["train.compile=true", "train.fused_loss=true", "train.attention=cudnn"]
SCALING = {  # name -> (GPUs, overrides) on llama3-1b-untied, micro-batch 4 per data-parallel rank
    "dp": [(g, []) for g in (1, 2, 4, 8)], "z1": [(g, ["parallel.zero=1"]) for g in (2, 4, 8)],
    "z3": [(g, ["parallel.zero=3"]) for g in (2, 4, 8)],
    "tp": [(g, [f"parallel.tp={g}", "parallel.sp=true"]) for g in (2, 4, 8)],
    # collective matmuls run eager: compared with the same eager tp layout (the exposed tp communication they hide)
    "tp-eager": [(g, [f"parallel.tp={g}", "parallel.sp=true", "train.compile=false"]) for g in (2, 4, 8)],
    "tp-async": [(g, [f"parallel.tp={g}", "parallel.sp=true", "parallel.async_tp=true", "train.compile=false"])
                 for g in (2, 4, 8)],
    "pp": [(g, [f"parallel.pp={g}", "parallel.schedule=1f1b"]) for g in (2, 4)],
}


RUNS = Path(os.environ.get("MEGALOOM_MULTI_RUNS", "/tmp/megaloom-multi-runs"))  # run dirs, apart from the logs


def megaloom_train(name: str, gpus: int, overrides: list[str], out: Path, timeout: int) -> dict:
    """One `megaloom train` run (its run.dir under RUNS); its metrics rows (or the failure's tail)."""
    run = RUNS / name
    cmd = [sys.executable, "-m", "megaloom", "train", *(["--nproc", str(gpus)] if gpus > 1 else []),
           *overrides, f"run.dir={run}", "checkpoint.resume=none"]
    t0 = time.perf_counter()
    with open(out / f"{name}.log", "w") as log:
        try:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    rows = []
    if (run / "metrics.jsonl").is_file():
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    print(f"{name}: rc={rc} {len(rows)} rows in {time.perf_counter() - t0:.0f}s", flush=True)
    return {"rc": rc, "rows": rows, "tail": (out / f"{name}.log").read_text()[-1500:] if rc else ""}


def speed(rows: list[dict], gpus: int) -> dict:
    """Median tokens/s (whole job, per GPU) and MFU after the first two logged rows (compilation, warm-up)."""
    use = [r for r in rows[2:] if r.get("tokens_per_s")] or [r for r in rows if r.get("tokens_per_s")]
    if not use:
        return {}
    tps = statistics.median(r["tokens_per_s"] for r in use)
    mfu = [r["mfu"] for r in use if r.get("mfu") is not None]
    return {"tokens_per_s": round(tps), "tokens_per_s_per_gpu": round(tps / gpus),
            "mfu": round(statistics.median(mfu), 4) if mfu else None,
            "peak_mem_gb": max((r.get("mem_gb") or 0) for r in use) or None}


def emit(results: Path, row: dict) -> None:
    with open(results, "a") as f:
        f.write(json.dumps(row) + "\n")
    print("RESULT " + json.dumps(row), flush=True)


def part_parity(gpus: int, out: Path, results: Path, base: dict) -> None:
    for model, cases in ((SMALL, PARITY), (MOE, PARITY_MOE)):
        todo = {n: c for n, c in cases.items() if c[0] <= gpus}
        kind = "moe" if model is MOE else "dense"
        ref = megaloom_train(f"parity-{kind}-1gpu", 1, [*model, *COMMON], out, 240)
        if ref["rc"] or not ref["rows"]:
            emit(results, {**base, "part": "parity", "model": kind, "layout": "1gpu", "gpus": 1,
                           "error": ref["tail"][-400:]})
            continue
        r0, r1 = ref["rows"][0]["loss"], ref["rows"][-1]["loss"]
        emit(results, {**base, "part": "parity", "model": kind, "layout": "1gpu", "gpus": 1, "first_loss": r0,
                       "final_loss": r1, **speed(ref["rows"], 1)})
        for name, (g, extra) in todo.items():
            got = megaloom_train(f"parity-{name}", g, [*model, *COMMON, *extra], out, 240)
            if got["rc"] or not got["rows"]:
                emit(results, {**base, "part": "parity", "layout": name, "gpus": g, "error": got["tail"][-400:]})
                continue
            g0, g1 = got["rows"][0]["loss"], got["rows"][-1]["loss"]
            emit(results, {**base, "part": "parity", "model": kind, "layout": name, "gpus": g,
                           "first_loss": g0, "first_loss_1gpu": r0, "final_loss": g1, "final_loss_1gpu": r1,
                           "first_ok": abs(g0 - r0) <= 1e-3 * r0, "final_ok": abs(g1 - r1) <= 0.01 * r1})


def part_scaling(gpus: int, out: Path, results: Path, base: dict) -> None:
    model = ["model.preset=llama3-1b-untied", "train.seq_len=4096", "train.micro_batch_size=4", "train.steps=12",
             "train.log_every=1", "train.eval_every=0", "checkpoint.every=0", "checkpoint.final=false",
             "run.tensorboard=false", "train.precision=bf16", "train.warmup_steps=2", *FAST]
    for layout, runs in SCALING.items():
        for g, extra in runs:
            if g > gpus:
                continue
            tp = next((int(x.split("=")[1]) for x in extra if x.startswith("parallel.tp=")), 1)
            pp = next((int(x.split("=")[1]) for x in extra if x.startswith("parallel.pp=")), 1)
            dp = g // (tp * pp)
            micro = 4 * (pp if pp > 1 else 1)  # pipelines need pp micro-batches in flight
            name = f"scaling-{layout}-{g}gpu"
            got = megaloom_train(name, g, [*model, *extra, f"train.global_batch_size={micro * dp}"], out, 280)
            emit(results, {**base, "part": "scaling", "model": "llama3-1b-untied", "seq_len": 4096,
                           "layout": layout, "gpus": g, "micro_batch": 4, "global_batch": micro * dp,
                           **(speed(got["rows"], g) if not got["rc"] else {"error": got["tail"][-400:]})})


def part_cp(gpus: int, out: Path, results: Path, base: dict) -> None:
    for seq in (32768, 65536):
        for cp in (c for c in (2, 4, 8) if c <= gpus):
            for mode in ("ring", "alltoall"):
                name = f"cp{cp}-{mode}-{seq // 1024}k"
                over = ["model.preset=llama3-1b-untied", f"train.seq_len={seq}", f"model.max_seq_len={seq}",
                        "train.micro_batch_size=1", f"train.global_batch_size={gpus // cp}", "train.steps=8",
                        "train.log_every=1", "train.eval_every=0", "checkpoint.every=0", "checkpoint.final=false",
                        "run.tensorboard=false", "train.precision=bf16", "train.warmup_steps=2", *FAST,
                        f"parallel.cp={cp}", f"parallel.cp_mode={mode}"]
                got = megaloom_train(name, gpus, over, out, 280)
                emit(results, {**base, "part": "cp", "model": "llama3-1b-untied", "seq_len": seq,
                               "layout": f"cp{cp}-{mode}-dp{gpus // cp}", "gpus": gpus,
                               **(speed(got["rows"], gpus) if not got["rc"] else {"error": got["tail"][-400:]})})


def visible_gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:
        return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("part", choices=("parity", "scaling", "cp"))
    ap.add_argument("--gpus", type=int, default=0, help="GPUs to use (default: all visible)")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/megaloom-multi"))
    ap.add_argument("--results", default=None, help="rows file (default: OUT/results.jsonl)")
    args = ap.parse_args()
    gpus = args.gpus or visible_gpus()
    if gpus < 1:
        print("multi_gpu.py: no CUDA GPU visible", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = Path(args.results) if args.results else out / "results.jsonl"
    import torch

    base = {"run_id": time.strftime("%Y%m%dT%H%M%S", time.gmtime()), "date": date.today().isoformat(),
            "gpu": torch.cuda.get_device_name(0), "gpus_on_machine": gpus, "torch": torch.__version__,
            "framework": "megaloom", "commit": os.environ.get("MEGALOOM_COMMIT", "unknown")}
    {"parity": part_parity, "scaling": part_scaling, "cp": part_cp}[args.part](gpus, out, results, base)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
