"""Compare the loss of precision runs against bf16, pairing runs of the same seed (`run_precision.sh` output).

    python bench/compare_precision.py DIR        # DIR holds metrics_<name>.jsonl files

Names are ``<precision>[_<variant>][_seed<N>]`` as `run_precision.sh` writes them: ``bf16``, ``fp8``,
``fp8_rowwise``, ``fp8_blockwise_seed2``, ``bf16_seed2``, ... A run without ``_seed<N>`` used the default seed.
Each non-bf16 run is compared with the bf16 run of the same seed: the mean training loss over the last ``--tail``
logged steps, and the eval loss at the end. A pair that did not reach the same step (one run stopped by its
timeout) is compared at the last step both reached, and says so. bf16 runs of different seeds give the noise floor.

Blockwise fp8 against bf16 over 2,000 steps at three seeds, and the qwen3-moe-2.6b speed of fp8 experts, in one
device call on one H200 (every run has its own timeout, 300 s for the six side by side and 125 s for each speed
run, so the call ends inside 10 minutes; a loss run stopped by its timeout is compared where it stopped):

    bash bench/run_precision.sh block moe_fp8

``block``: a 25M-parameter Llama-style model (d_model 512, 6 layers, FFN 1536: every GEMM dimension a multiple of
512, so the kernel runs unpadded) on the embedded corpus, sequence 512, batch 4, 2,000 steps (4.1M tokens, about
three epochs), eval every 500 steps; bf16 and ``train.fp8_recipe=blockwise`` (first and last blocks bf16, the
default) at seeds 1, 2, 3, the six runs side by side on the GPU (small models are launch-bound, so they share it;
their tokens/s are not speeds); then this script over $OUT. ``moe_fp8``: `bench_train.py` on qwen3-moe-2.6b (seq
4096, micro-batch 4, compiled, fused loss, cuDNN attention) with fp8 tensorwise linears, without and with
``--fp8-experts``; RESULT rows in $OUT/results.jsonl (``MOE_RUNS="bf16 fp8 fp8_experts"`` adds bf16, a longer call).
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from megaloom.observe.metrics import read_metrics  # noqa: E402

DEFAULT_SEED = "default"


def summarize(path: Path, tail: int) -> dict:
    rows = read_metrics(path)
    losses = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    evals = [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r]
    out = {"steps": rows[-1]["step"] if rows else 0, "tokens_per_s": rows[-1].get("tokens_per_s") if rows else None,
           "losses": losses, "evals": evals, "tail": tail}
    return {**out, **_until(out, out["steps"])}


def _until(s: dict, step: int) -> dict:
    """``s``'s train loss (mean of the last ``tail`` logged losses) and eval loss (the last) up to ``step``."""
    losses = [x for st, x in s["losses"] if st <= step][-s["tail"]:]
    evals = [x for st, x in s["evals"] if st <= step]
    return {"train": sum(losses) / len(losses) if losses else float("nan"),
            "eval": evals[-1] if evals else float("nan")}


def split_name(name: str) -> tuple[str, str]:
    """("fp8_rowwise", "2") from "fp8_rowwise_seed2"; the seed is DEFAULT_SEED when absent."""
    m = re.fullmatch(r"(.+?)_seed(\d+)", name)
    return (m.group(1), m.group(2)) if m else (name, DEFAULT_SEED)


def compare(runs: dict[str, dict]) -> list[dict]:
    """One row per non-bf16 run that has a bf16 partner of the same seed: relative gaps in percent."""
    by_key = {split_name(n): s for n, s in runs.items()}
    out = []
    for (kind, seed), s in sorted(by_key.items()):
        ref = by_key.get(("bf16", seed))
        if kind == "bf16" or ref is None:
            continue
        at = min(s["steps"], ref["steps"])
        if s["steps"] != ref["steps"] and "losses" in s and "losses" in ref:  # one stopped early: the common step
            s, ref = _until(s, at), _until(ref, at)
        out.append({"run": kind, "seed": seed, "train_gap_pct": 100 * (s["train"] - ref["train"]) / ref["train"],
                    "eval_gap_pct": 100 * (s["eval"] - ref["eval"]) / ref["eval"], "at_step": at})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", type=Path)
    ap.add_argument("--tail", type=int, default=5, help="logged steps averaged at the end (5 = the last 50 steps "
                                                       "at train.log_every=10)")
    args = ap.parse_args(argv)
    runs = {p.stem.removeprefix("metrics_"): summarize(p, args.tail) for p in sorted(args.dir.glob("metrics_*.jsonl"))}
    if not runs:
        print(f"no metrics_*.jsonl in {args.dir}", file=sys.stderr)
        return 1
    print(f"{'run':<22}{'steps':>6}{'train loss':>12}{'eval loss':>11}{'tokens/s':>11}")
    for name, s in runs.items():
        tps = f"{s['tokens_per_s']:,.0f}" if s["tokens_per_s"] else "-"
        print(f"{name:<22}{s['steps']:>6}{s['train']:>12.4f}{s['eval']:>11.4f}{tps:>11}")
    rows = compare(runs)
    if rows:
        print(f"\n{'vs bf16 (same seed)':<22}{'seed':>8}{'train gap':>11}{'eval gap':>10}")
        for r in rows:
            print(f"{r['run']:<22}{r['seed']:>8}{r['train_gap_pct']:>+10.2f}%{r['eval_gap_pct']:>+9.2f}%"
                  f"   at step {r['at_step']}")
        for kind in sorted({r["run"] for r in rows}):
            gaps = [r["train_gap_pct"] for r in rows if r["run"] == kind]
            evals = [r["eval_gap_pct"] for r in rows if r["run"] == kind]
            if len(gaps) > 1:
                print(f"{kind}: mean over {len(gaps)} seeds: train gap {statistics.mean(gaps):+.2f}% "
                      f"(std {statistics.stdev(gaps):.2f}), eval gap {statistics.mean(evals):+.2f}% "
                      f"(std {statistics.stdev(evals):.2f})")
    bf16 = [s["train"] for (k, _), s in ((split_name(n), s) for n, s in runs.items()) if k == "bf16"]
    if len(bf16) > 1:
        spread = 100 * (max(bf16) - min(bf16)) / min(bf16)
        print(f"bf16 across {len(bf16)} seeds: train loss spread {spread:.2f}% (the run-to-run noise floor)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
