"""train.optimizer_offload on one GPU: tokens/s and peak device memory with and without it where both fit, and a
model that does not fit without it trained with it (issue 51).

Synthetic tokens, the trainer's model, `TrainStep` and optimizers (megaloom/optim/build.py on the device,
megaloom/optim/offload.py on the host). Each run: ``--warmup`` steps, then ``--steps`` steps timed back to back with
one sync at the end (the offloaded update overlaps the next forward, so per-step syncs would hide that).

The model that does not fit: llama3-8b's shape cut to 22 blocks (5.85B parameters; bf16 autocast, recompute
full, fused loss, micro-batch 1 x 2048). The memory planner (`megaloom memory`, plan_memory with device=cuda)
puts it at ~87 GiB per GPU with AdamW on the device (fp32 weights 4 + gradients 4 + moments 8 bytes per parameter)
and ~44 GiB offloaded (the moments and fp32 masters, 16 bytes per parameter with the gradient buffer, ~87 GiB of
host memory). Printed beside the measurement; ``--big-on-device`` also tries it without offload (expect an OOM).

The GPU command (one H100 80GB, 128 GiB host; ~2 minutes):

    python bench/bench_offload.py --device cuda --results bench/results.jsonl

CPU smoke test (a tiny model, seconds):

    python bench/bench_offload.py --device cpu --preset tiny --seq-len 64 --micro-batch 2 --steps 3 --warmup 1 \
        --big-preset tiny --big-layers 2 --big-seq-len 64 --big-steps 2 model.vocab_size=256
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megaloom import accelerator  # noqa: E402
from megaloom.config import load_config  # noqa: E402
from megaloom.models.attention_kernel import attention_backend  # noqa: E402
from megaloom.models.transformer import build_on_device  # noqa: E402
from megaloom.optim.build import build_optimizer  # noqa: E402
from megaloom.optim.offload import build_offloaded  # noqa: E402
from megaloom.planning.memory_plan import plan_memory  # noqa: E402
from megaloom.step import TrainStep  # noqa: E402
from megaloom.train import apply_train_options  # noqa: E402

GIB = 2**30


def make_config(preset: str, seq_len: int, micro: int, offload: bool, extra: list[str]):
    return load_config(None, [f"model.preset={preset}", f"train.seq_len={seq_len}",
                              f"model.max_seq_len={max(seq_len, 8192)}", f"train.micro_batch_size={micro}",
                              f"train.global_batch_size={micro}", f"train.optimizer_offload={str(offload).lower()}",
                              "checkpoint.async_save=false", *extra])


def planned(cfg, device: torch.device) -> dict:
    """The memory plan's per-GPU peak and host line (as `megaloom memory` reports them)."""
    plan = plan_memory(cfg, device="cuda" if accelerator.is_cuda(device) else "cpu")
    return {"planned_peak_gib": plan.peak / GIB, "planned_host_gib": plan.optimizer_host / GIB}


def run(cfg, device: torch.device, steps: int, warmup: int) -> dict:
    """Build, train ``warmup`` + ``steps`` steps on synthetic tokens; tokens/s over the timed window and peak."""
    t = cfg.train
    torch.manual_seed(0)
    if accelerator.is_accelerator(device):
        accelerator.empty_cache()
        accelerator.reset_peak_memory_stats(device)
    model = build_on_device(cfg.model, device)
    apply_train_options(model, t, recompute_attention=attention_backend(cfg, device.type) == "math", device=device)
    if t.optimizer_offload:
        optimizer = build_offloaded(model, None, t, device)
    else:
        optimizer = build_optimizer(model, t, device)
    precision = t.precision if t.precision != "auto" else ("bf16" if accelerator.is_accelerator(device) else "fp32")
    step = TrainStep(model, optimizer, precision, device, t.micro_batch_size, grad_clip=1.0)
    vocab = cfg.model.vocab_size
    batch = torch.randint(0, vocab, (t.micro_batch_size, t.seq_len + 1), device=device)
    sync = (lambda: accelerator.synchronize(device)) if accelerator.is_accelerator(device) else (lambda: None)
    losses = []
    for _ in range(warmup):
        losses.append(step(batch).loss)
    step.settle()
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        losses.append(step(batch).loss)
    step.settle()
    sync()
    seconds = time.perf_counter() - t0
    peak = accelerator.max_memory_allocated(device) if accelerator.is_accelerator(device) else 0
    params = sum(p.numel() for p in model.parameters())
    tokens = steps * t.micro_batch_size * t.seq_len
    out = {"params": params, "step_s": seconds / steps, "tokens_per_s": tokens / seconds,
           "peak_gib": peak / GIB, "losses": [float(x) for x in losses],
           "host_gib": optimizer.host_bytes() / GIB if t.optimizer_offload else 0.0}
    del step, optimizer, model
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--preset", default="llama3-1b", help="the model that fits both ways")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--big-preset", default="llama3-8b", help="the model that needs offload (its shape)")
    ap.add_argument("--big-layers", type=int, default=22)
    ap.add_argument("--big-seq-len", type=int, default=2048)
    ap.add_argument("--big-steps", type=int, default=4)
    ap.add_argument("--big-on-device", action="store_true", help="also try the big model without offload")
    ap.add_argument("--results", default=None, help="append one JSON line here")
    ap.add_argument("overrides", nargs="*", help="extra overrides for both models, e.g. model.vocab_size=256")
    args = ap.parse_args()
    device = torch.device(args.device)
    gpu = accelerator.is_accelerator(device)
    lean = ["train.precision=bf16", "train.recompute=full", "train.fused_loss=true"] if gpu else []
    record = {"date": datetime.date.today().isoformat(), "bench": "offload", "device": accelerator.device_name(device),
              "host_fused_adamw": accelerator.host_fused_optimizer(), "runs": {}}
    for offload in (False, True):
        cfg = make_config(args.preset, args.seq_len, args.micro_batch, offload, [*lean[:1], *args.overrides])
        name = f"{args.preset}_{'offload' if offload else 'device'}"
        record["runs"][name] = {**planned(cfg, device), **run(cfg, device, args.steps, args.warmup)}
        print(name, {k: v for k, v in record["runs"][name].items() if k != "losses"}, flush=True)
    big = [f"model.n_layers={args.big_layers}", *lean, *args.overrides]
    for offload in ((True, False) if args.big_on_device else (True,)):  # offload first: an OOM leaves debris
        cfg = make_config(args.big_preset, args.big_seq_len, 1, offload, big)
        name = f"{args.big_preset}-{args.big_layers}L_{'offload' if offload else 'device'}"
        result = planned(cfg, device)
        try:
            result.update(run(cfg, device, args.big_steps, 1))
        except torch.OutOfMemoryError as e:  # expected without offload: the plan says it does not fit
            result["error"] = f"OOM: {str(e).splitlines()[0]}"
        record["runs"][name] = result
        print(name, {k: v for k, v in result.items() if k != "losses"}, flush=True)
    if args.results:
        with open(args.results, "a") as f:
            f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
