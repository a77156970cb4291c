"""1-bit Adam / 1-bit LAMB against AdamW / LAMB: final losses over several seeds, and bytes per step on the
data-parallel group (issue 40). Not part of the test suite: it trains for minutes.

    python bench/onebit_convergence.py --out runs/onebit                 # tiny preset, dp=4, 600 steps, seeds 1-3
    python bench/onebit_convergence.py --out runs/onebit --pairs lamb    # 1-bit LAMB against LAMB
    python bench/onebit_convergence.py --out runs/onebit --summary       # the table again from the runs on disk
    python bench/onebit_convergence.py --out runs/onebit95m --device cuda --steps 2000 --warmup 300 \
        --extra model.preset=gpt2-124m train.micro_batch_size=8           # near the issue's 95M, GPUs

On one GPU, dp 4 simulated in one process (``--simulate-dp 4``: bench/onebit_simulate.py, the same optimizer and
compression code; AdamW then runs as one process on the same global batch, which is dp 4's arithmetic; no bytes
measurement). The issue's ~95M parameters: gpt2-124m's blocks with the corpus tokenizer's vocabulary. 2 optimizers
x 3 seeds must finish in ~6 minutes on an H100, so 600 steps (warm-up 120, as the CPU runs), global batch 16 x 256
tokens (each simulated rank 4 rows, one micro-batch): about 40 s a 1-bit run (4 rank passes + the exchange per
step), 15 s an AdamW run, plus start-up (an estimate, not measured yet):

    python bench/onebit_convergence.py --out runs/onebit95m_sim --device cuda --simulate-dp 4 --steps 600 \
        --warmup 120 --extra model.preset=gpt2-124m model.vocab_size=0 train.seq_len=256 train.micro_batch_size=4 \
        train.precision=bf16

The issue's full 2,000 steps / warm-up 300: the same with --steps 2000 --warmup 300 (~15 minutes). CPU smoke test:

    python bench/onebit_convergence.py --out /tmp/onebit_sim --simulate-dp 4 --steps 10 --warmup 4 --seeds 1

Each run is `megaloom train --nproc N` on the embedded corpus with one setting changed (train.optimizer) and
the seed; every other setting is the same (COMMON). The final train loss is the mean of the last 50 logged steps
(as bench/compare_precision.py takes it), with the eval loss at the end beside it; the gap is the 1-bit run's
over its peer of the same seed, and its mean over the seeds is the number compared with 1%.

Bytes: a world of N processes (gloo) runs each optimizer through `Trainer` for the warm-up and 5 more steps with
a `comm.CommTally` on the mesh's recorder, keyed by the step an op belongs to; the bytes of the steps after the
warm-up (buffer bytes as nccl-tests sizes them, and the bytes each rank sends: `comm.sent_bytes`) per step.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's megaloom, also in the spawned ranks (they inherit sys.path)
sys.path.insert(0, str(ROOT / "bench"))  # onebit_simulate

PEERS = {"adam": ("adamw", "onebit_adam"), "lamb": ("lamb", "onebit_lamb")}


def common(steps: int, warmup: int, device: str = "cpu", extra: tuple[str, ...] = ()) -> list[str]:
    """The settings every run shares; ``extra`` (later, so they win): e.g. a larger model on GPUs."""
    return ["model.preset=tiny", f"train.steps={steps}", f"train.onebit_warmup_steps={warmup}", "train.log_every=1",
            "train.eval_every=0", "train.eval_batches=8", "checkpoint.every=0", "checkpoint.final=false",
            "run.tensorboard=false", f"train.device={device}", *extra]


def lr_overrides(optimizer: str, args) -> list[str]:
    """LAMB's own learning rate: at the tiny preset's 3e-3 LAMB itself trails AdamW (loss 7.3 at step 120 against
    4.9) and a variance frozen that early leaves 1-bit LAMB 7.5% behind it; at 2e-2 LAMB keeps up with AdamW."""
    if "lamb" not in optimizer or not args.lamb_lr:
        return []
    return [f"train.lr={args.lamb_lr}", f"train.min_lr={args.lamb_lr / 10}"]


def run_dir(out: Path, optimizer: str, seed: int) -> Path:
    return out / f"{optimizer}_seed{seed}"


def train(out: Path, optimizer: str, seed: int, args) -> float:
    d = run_dir(out, optimizer, seed)
    if (d / "metrics.jsonl").is_file() and len(_rows(d)) >= args.steps:
        return 0.0  # done before (the script can be resumed)
    t0 = time.perf_counter()
    if args.simulate_dp and optimizer.startswith("onebit"):
        simulated_run(d, seed, args)
        return time.perf_counter() - t0
    cmd = [sys.executable, "-m", "megaloom", "train", "--nproc", str(args.nproc), f"run.dir={d}",
           f"train.optimizer={optimizer}", f"train.seed={seed}",
           *common(args.steps, args.warmup, args.device, tuple(args.extra)),
           *lr_overrides(optimizer, args)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, cwd=ROOT)  # this checkout's megaloom
    return time.perf_counter() - t0


def simulated_run(d: Path, seed: int, args) -> None:
    """1-bit Adam over ``args.simulate_dp`` ranks simulated in this process (bench/onebit_simulate.py) on the data,
    model, schedule and evaluation `megaloom train` would use; metrics.jsonl as the trainer writes it."""
    from onebit_simulate import SimulatedOnebitAdam

    from megaloom import accelerator
    from megaloom.config import load_config
    from megaloom.optim.build import lr_at, set_lr
    from megaloom.step import autocast_ctx
    from megaloom.training.trainer import Trainer

    shutil.rmtree(d, ignore_errors=True)
    cfg = load_config(None, [f"run.dir={d}", "train.optimizer=adamw", f"train.seed={seed}",  # its AdamW: unused
                             *common(args.steps, args.warmup, args.device, tuple(args.extra))])
    trainer = Trainer(cfg).build()
    t, device, precision = trainer.cfg.train, trainer.device, trainer.precision
    sim = SimulatedOnebitAdam(trainer.model, t, args.simulate_dp, trainer.cfg.parallel.bucket_mb,
                              forward_ctx=lambda: autocast_ctx(precision, device))
    print(f"simulated dp {args.simulate_dp}: {sum(p.numel() for p in trainer.model.parameters()):,} parameters, "
          f"{t.global_batch_size} x {t.seq_len} tokens a step", flush=True)
    # a rank's rows in micro-batches of at most the resolved size (which one process chose for the whole batch)
    micro = math.gcd(t.micro_batch_size, t.global_batch_size // args.simulate_dp)
    steps = 0
    # line by line: a run cut short (a device call's limit) keeps its rows
    with open(d / "metrics.jsonl", "w") as metrics:
        for step, batch in enumerate(trainer._loader()):
            set_lr(sim, lr_at(step, t))
            loss, norm = sim.step(batch.to(device, non_blocking=True), micro)
            metrics.write(json.dumps({"step": step + 1, "loss": loss, "grad_norm": norm}) + "\n")
            steps = step + 1
            if steps % 20 == 0:
                metrics.flush()
        trainer.train_step.optimizer = sim.opt  # (evaluation reads the model only)
        metrics.write(json.dumps({"step": steps, **trainer._evaluate()}) + "\n")
    del trainer, sim
    accelerator.empty_cache()


def _rows(d: Path) -> list[dict]:
    return [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]


def final(d: Path, upto: int | None = None) -> dict:
    """The mean loss of the last 50 steps (of the first ``upto``: a run cut short is compared at the step it
    reached), and the eval loss at the end (None when cut short)."""
    rows = _rows(d)
    losses = [r["loss"] for r in rows if r.get("loss") is not None]
    evals = [r["eval_loss"] for r in rows if r.get("eval_loss") is not None]
    n = len(losses) if upto is None else min(upto, len(losses))
    return {"train": statistics.fmean(losses[n - 50:n]), "eval": evals[-1] if evals and n == len(losses) else None,
            "steps": n}


# ------------------------------------------------------------------------------------------------------ bytes


def _per_step_tally(trainer):
    from megaloom.parallel import comm

    class PerStep(comm.CommTally):
        """Bytes per step on the data-parallel group, keyed by the steps done when the op ran (so the metric line's
        loss all-reduce after a step lands in the next one: one scalar)."""

        def __init__(self) -> None:
            super().__init__({trainer.mesh.dp_cp_group: "dp"}, inner=trainer.mesh.recorder)
            self.per_step: dict[int, list[float]] = {}

        def _add(self, op, group, nbytes):
            super()._add(op, group, nbytes)
            if self.name_of(group) == "dp":
                row = self.per_step.setdefault(trainer.step, [0.0, 0.0])
                row[0] += nbytes
                row[1] += comm.sent_bytes(op, comm.group_size(group), nbytes)

    return PerStep()


def _bytes_rank(rank: int, world: int, tmp: str, overrides: list[str], optimizers: list[str], warmup: int,
                out_file: str) -> None:
    import torch

    from megaloom.config import load_config
    from megaloom.runtime import Runtime, start_process_group
    from megaloom.training.trainer import Trainer

    torch.set_num_threads(1)
    device = torch.device("cpu")
    start_process_group(device, rank, world, timedelta(seconds=300), init_method=f"file://{tmp}/init")
    result = {}
    for optimizer in optimizers:
        cfg = load_config(None, [*overrides, f"train.optimizer={optimizer}", f"run.dir={tmp}/{optimizer}",
                                 f"train.steps={warmup + 5}"])
        trainer = Trainer(cfg, runtime=Runtime(device=device, rank=rank, world_size=world, local_rank=rank)).build()
        tally = _per_step_tally(trainer)
        trainer.mesh.recorder = tally
        trainer.fit()
        after = [v for s, v in sorted(tally.per_step.items()) if warmup <= s < warmup + 5]  # the compressed steps
        params = sum(p.numel() for p in trainer.model.parameters())
        result[optimizer] = {"params": params, "per_step": tally.per_step, "rows": tally.rows(),
                             "bytes": statistics.fmean(v[0] for v in after),
                             "sent": statistics.fmean(v[1] for v in after)}
    if rank == 0:
        Path(out_file).write_text(json.dumps(result, indent=1))
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


def measure_bytes(out: Path, optimizers: list[str], args) -> dict:
    import torch.multiprocessing as mp

    target = out / f"bytes_{'_'.join(optimizers)}.json"
    if not target.is_file():
        with tempfile.TemporaryDirectory(prefix="onebit-bytes-") as tmp:
            overrides = [o for o in common(args.steps, args.warmup, "cpu", tuple(args.extra))  # bytes: gloo on CPU
                         if not o.startswith("train.steps=")]
            mp.spawn(_bytes_rank, args=(args.nproc, tmp, overrides, optimizers, args.warmup, str(target)),
                     nprocs=args.nproc)
    return json.loads(target.read_text())


# ---------------------------------------------------------------------------------------------------- report


def report(out: Path, pair: str, args) -> dict:
    peer, onebit = PEERS[pair]
    seeds = []
    for seed in args.seeds:
        n = min(final(run_dir(out, o, seed))["steps"] for o in (peer, onebit))  # the step both reached
        a, b = final(run_dir(out, peer, seed), n), final(run_dir(out, onebit, seed), n)
        seeds.append({"seed": seed, peer: a, onebit: b, "gap_train": b["train"] / a["train"] - 1,
                      "gap_eval": (b["eval"] / a["eval"] - 1) if a["eval"] and b["eval"] else None})
    evals = [s["gap_eval"] for s in seeds if s["gap_eval"] is not None]
    mean = {"gap_train": statistics.fmean(s["gap_train"] for s in seeds),
            "gap_eval": statistics.fmean(evals) if len(evals) == len(seeds) else None}
    means = {opt: statistics.fmean(s[opt]["train"] for s in seeds) for opt in (peer, onebit)}
    return {"pair": pair, "seeds": seeds, "mean_gap_train": mean["gap_train"], "mean_gap_eval": mean["gap_eval"],
            "mean_train": means, "gap_of_means": means[onebit] / means[peer] - 1}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--pairs", default="adam", help="adam, lamb or adam,lamb")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--warmup", type=int, default=120, help="train.onebit_warmup_steps")
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--device", default="cpu", help="train.device of the training runs (cuda: one GPU per process)")
    ap.add_argument("--extra", nargs="*", default=[], help="more overrides for every run, e.g. model.preset=gpt2-124m "
                                                            "train.micro_batch_size=8 (the issue's 95M run on GPUs)")
    ap.add_argument("--lamb-lr", type=float, default=0.02, help="train.lr of both LAMB runs (0: the preset's)")
    ap.add_argument("--summary", action="store_true", help="only report the runs on disk")
    ap.add_argument("--only", default="", help="train this one optimizer of the pair, no report (several at once "
                                               "on one GPU; then --summary)")
    ap.add_argument("--simulate-dp", type=int, default=0, metavar="N",
                    help="one process (one GPU): 1-bit runs simulate N data-parallel ranks (bench/onebit_simulate.py), "
                         "AdamW runs as one process on the same global batch; no bytes measurement")
    args = ap.parse_args()
    if args.simulate_dp:
        args.nproc = 1  # the AdamW peers: one process, the global batch's mean gradient as dp N's all-reduce gives
    args.out = args.out.resolve()  # the runs start in the checkout (cwd=ROOT)
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    summary = {"date": time.strftime("%Y-%m-%d"), "args": {k: str(v) for k, v in vars(args).items()},
               "common": common(args.steps, args.warmup, args.device, tuple(args.extra)), "pairs": {}}
    for pair in args.pairs.split(","):
        if not args.summary:
            for seed in args.seeds:
                for optimizer in PEERS[pair]:
                    if args.only and optimizer != args.only:
                        continue
                    took = train(args.out, optimizer, seed, args)
                    print(f"{optimizer} seed {seed}: {final(run_dir(args.out, optimizer, seed))} ({took:.0f}s)",
                          flush=True)
        if args.only:
            continue
        summary["pairs"][pair] = report(args.out, pair, args)
        if not args.simulate_dp:
            summary["pairs"][pair]["bytes"] = measure_bytes(args.out, list(PEERS[pair]), args)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    for pair, r in summary["pairs"].items():
        peer, onebit = PEERS[pair]
        print(f"\n| seed | steps | {peer} train | {onebit} train | gap | {peer} eval | {onebit} eval | gap |")
        print("|---|---|---|---|---|---|---|---|")
        ev = lambda x: f"{x:.4f}" if x is not None else "-"  # noqa: E731  (a run cut short: no eval)
        for s in r["seeds"]:
            ge = f"{100 * s['gap_eval']:+.2f}%" if s["gap_eval"] is not None else "-"
            print(f"| {s['seed']} | {s[peer]['steps']} | {s[peer]['train']:.4f} | {s[onebit]['train']:.4f} | "
                  f"{100 * s['gap_train']:+.2f}% | {ev(s[peer]['eval'])} | {ev(s[onebit]['eval'])} | {ge} |")
        me = f"{100 * r['mean_gap_eval']:+.2f}%" if r["mean_gap_eval"] is not None else "-"
        print(f"mean gap over seeds: train {100 * r['mean_gap_train']:+.2f}%, eval {me}")
        b = r.get("bytes")
        if b is None:
            continue
        print(f"bytes per step on dp after the warm-up ({b[peer]['params']:,} parameters): {peer} "
              f"{b[peer]['bytes']:,.0f} buffer / {b[peer]['sent']:,.0f} sent; {onebit} {b[onebit]['bytes']:,.0f} / "
              f"{b[onebit]['sent']:,.0f}: {b[peer]['bytes'] / b[onebit]['bytes']:.1f}x / "
              f"{b[peer]['sent'] / b[onebit]['sent']:.1f}x fewer")


if __name__ == "__main__":
    main()
