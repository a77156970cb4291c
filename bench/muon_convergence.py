"""Muon against AdamW (issue 51): final train / eval losses over several seeds, the same learning rate for both
(Muon's update is scaled to AdamW's RMS, so train.lr carries over). Not part of the test suite: it trains for
minutes to hours.

    python bench/muon_convergence.py --out runs/muon                     # tiny preset, CPU, 2000 steps, seeds 1-3
    python bench/muon_convergence.py --out runs/muon --steps 150 --warmup 15   # what 2 shared CPU cores allow
    python bench/muon_convergence.py --out runs/muon --summary           # the table again from the runs on disk
    python bench/muon_convergence.py --out runs/muon --steps 3 --seeds 1 --extra model.preset=gpt2-124m  # smoke

The Python-stdlib data (as bench/onebit_convergence.py's runs: the standard library's *.py outside test*/tests/
idlelib/site-packages folders, 674 files, 3,506,909 tokens with the default 8192 tokenizer):

    megaloom preprocess --tokenizer <cache>/default-corpus-<hash>/tokenizer.json --out runs/stdlib_tok <files>
    python bench/muon_convergence.py --out runs/muon_stdlib --steps 150 --warmup 15 \\
        --extra data.paths=runs/stdlib_tok data.tokenizer=<cache>/default-corpus-<hash>/tokenizer.json

On one GPU, ~95M parameters (gpt2-124m's shape with a 16k vocabulary: 85M in the blocks, 12.6M embedding), 2000
steps, 3 seeds, the default corpus with its tokenizer trained at 16384 (data.default_vocab_size; model.vocab_size=0
takes the tokenizer's: a model.vocab_size=16384 over the default 8192 tokenizer would leave half the embedding
rows unused):

    python bench/muon_convergence.py --out runs/muon95m --device cuda --steps 2000 --warmup 200 \\
        --extra model.preset=gpt2-124m data.default_vocab_size=16384 model.vocab_size=0 train.seq_len=512 \\
        train.global_batch_size=32 train.micro_batch_size=16 train.lr=6e-4 train.min_lr=6e-5

Its first 3 steps ran on CPU (--device cpu --steps 3, the same --extra; 2026-12-06, 2 shared cores): AdamW about
90 s a step, Muon about 290 s (Newton-Schulz in bf16 is slow on a CPU), 11-12 GB of host memory; losses 9.93 ->
9.19 (AdamW) and 9.93 -> 9.92 (Muon: lr 3e-6 .. 9e-6 in the warm-up), evaluation at step 3 included.

Each run is `megaloom train` on the embedded corpus with one setting changed (train.optimizer) and the seed; every
other setting is the same (`common`). The final train loss is the mean of the last 50 logged steps (as
bench/onebit_convergence.py takes it), the eval loss at the end beside it; the gap is Muon's over AdamW's of the
same seed, then its mean over seeds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OPTIMIZERS = ("adamw", "muon")


def common(steps: int, warmup: int, device: str, extra: tuple[str, ...]) -> list[str]:
    """The settings every run shares; ``extra`` (later, so they win): e.g. a larger model on a GPU."""
    return ["model.preset=tiny", f"train.steps={steps}", f"train.warmup_steps={warmup}", "train.log_every=1",
            f"train.eval_every={steps}", "train.eval_batches=8", "checkpoint.every=0", "checkpoint.final=false",
            "run.tensorboard=false", f"train.device={device}", *extra]


def run_dir(out: Path, optimizer: str, seed: int) -> Path:
    return out / f"{optimizer}_seed{seed}"


def _rows(d: Path) -> list[dict]:
    f = d / "metrics.jsonl"
    return [json.loads(line) for line in f.read_text().splitlines()] if f.is_file() else []


def train(out: Path, optimizer: str, seed: int, args) -> float:
    """One run (skipped when its metrics already hold every step: the script can be resumed); its seconds."""
    d = run_dir(out, optimizer, seed)
    if len([r for r in _rows(d) if r.get("loss") is not None]) >= args.steps:
        return 0.0
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "megaloom", "train", f"run.dir={d}", f"train.optimizer={optimizer}",
           f"train.seed={seed}", *common(args.steps, args.warmup, args.device, tuple(args.extra))]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, cwd=ROOT)  # this checkout's megaloom
    return time.perf_counter() - t0


def final(d: Path) -> dict:
    rows = _rows(d)
    losses = [r["loss"] for r in rows if r.get("loss") is not None]
    evals = [r["eval_loss"] for r in rows if r.get("eval_loss") is not None]
    return {"train": statistics.fmean(losses[-50:]), "eval": evals[-1] if evals else None, "steps": len(losses)}


def table(out: Path, seeds: list[int]) -> str:
    """Markdown: per seed AdamW's and Muon's final losses and Muon's gap; then the means."""
    lines = ["| seed | steps | AdamW train | Muon train | gap | AdamW eval | Muon eval | gap |",
             "|---|---|---|---|---|---|---|---|"]
    gaps_t, gaps_e = [], []
    for seed in seeds:
        a, m = (final(run_dir(out, o, seed)) for o in OPTIMIZERS)
        gt = (m["train"] / a["train"] - 1) * 100
        ge = (m["eval"] / a["eval"] - 1) * 100 if a["eval"] and m["eval"] else float("nan")
        gaps_t.append(gt)
        gaps_e.append(ge)
        lines.append(f"| {seed} | {min(a['steps'], m['steps'])} | {a['train']:.4f} | {m['train']:.4f} | {gt:+.2f}% "
                     f"| {a['eval'] or float('nan'):.4f} | {m['eval'] or float('nan'):.4f} | {ge:+.2f}% |")
    lines.append(f"| mean | | | | {statistics.fmean(gaps_t):+.2f}% | | | {statistics.fmean(gaps_e):+.2f}% |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--extra", nargs="*", default=[], help="more key=value settings for every run")
    ap.add_argument("--summary", action="store_true", help="print the table from the runs on disk, train nothing")
    ap.add_argument("--only", choices=OPTIMIZERS, help="train this optimizer only, no table (several at once on one "
                                                       "GPU; then --summary)")
    args = ap.parse_args()
    if not args.summary:
        for seed in args.seeds:
            for optimizer in (args.only,) if args.only else OPTIMIZERS:
                secs = train(args.out, optimizer, seed, args)
                print(f"{optimizer} seed {seed}: {secs:.0f} s", flush=True)
    if args.only:
        return
    print(table(args.out, args.seeds))


if __name__ == "__main__":
    main()
