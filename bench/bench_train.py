"""Throughput of megaloom's real training step on one GPU: tokens/s, MFU and peak memory.

Synthetic tokens (their values do not change step time), the same model, optimizer and `TrainStep` that
`megaloom train` uses. MFU counts FLOPs as TorchTitan does (6 x matmul parameters + 12 x layers x d_model x
seq per token, attention in full), against the device's dense bf16 peak, so figures compare with its logs.

    python bench/bench_train.py --preset llama3-1b --seq-len 4096 --micro-batch 4 --compile \
        --results bench/results.jsonl
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megaloom.config import load_config  # noqa: E402
from megaloom.models.attention_kernel import attention_backend  # noqa: E402
from megaloom.models.transformer import build_on_device  # noqa: E402
from megaloom.observe.flops import device_peak_flops, flops_per_token, matmul_params  # noqa: E402
from megaloom.optim.build import build_optimizer  # noqa: E402
from megaloom.planning.levers import choose_levers  # noqa: E402
from megaloom.step import TrainStep  # noqa: E402
from megaloom.train import apply_train_options  # noqa: E402
from megaloom.training.compile_saves import set_lean_saves  # noqa: E402


def git_commit() -> str:
    if os.environ.get("MEGALOOM_COMMIT"):  # the GPU machine gets a copy of the tree without .git
        return os.environ["MEGALOOM_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True,
                                       cwd=Path(__file__).parent, stderr=subprocess.DEVNULL).strip()
    except Exception:
        return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="llama3-1b")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5, help="steps excluded from the median (compilation, autotune)")
    ap.add_argument("--precision", default="bf16", help="bf16, fp16, fp32 or fp8 (the blocks' linears in float8)")
    ap.add_argument("--fp8-recipe", default="tensorwise", choices=("tensorwise", "rowwise", "blockwise"))
    ap.add_argument("--fp8-experts", action="store_true",
                    help="fp8: the MoE experts' grouped GEMMs in rowwise fp8 too (train.fp8_experts)")
    ap.add_argument("--fp8-keep-first-last", action=argparse.BooleanOptionalAction, default=True,
                    help="fp8: keep the first and last blocks in bf16 (--no-fp8-keep-first-last converts all)")
    ap.add_argument("--fp8-fast-accum", action=argparse.BooleanOptionalAction, default=True,
                    help="fp8: fast (reduced-precision) accumulation in the forward GEMM; --no-fp8-fast-accum = fp32")
    ap.add_argument("--fp8-keep-attention", action="store_true", help="fp8: attention projections stay bf16")
    ap.add_argument("--recompute", default="none")
    ap.add_argument("--recompute-layers", type=int, default=0, help="recompute=full: only the first N blocks")
    ap.add_argument("--recompute-casts", action="store_true",
                    help="compiled blocks recompute weight casts / norm outputs in backward (train.recompute_casts)")
    ap.add_argument("--overlap-optimizer", action="store_true",
                    help="the AdamW step beside the next forward on a side stream (train.overlap_optimizer)")
    ap.add_argument("--window", action="store_true",
                    help="time the steps after --warmup back to back, one sync at the end (mean step): what a lever "
                         "that overlaps one step's end with the next one's start needs (--overlap-optimizer)")
    ap.add_argument("--offload", action="store_true", help="keep saved activations in pinned CPU memory")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--fused-loss", action="store_true",
                    help="head + cross-entropy fused and chunked (train.fused_loss): never the full fp32 logits")
    ap.add_argument("--loss-chunk", type=int, default=0, help="--fused-loss: tokens per chunk (0 = default)")
    ap.add_argument("--results", default=None, help="append one JSON line here")
    ap.add_argument("--profile", default=None, help="after the timed steps, profile one step into this folder "
                                                  "(trace.json.gz, breakdown.json; see profile_breakdown.py)")
    ap.add_argument("--run-id", default=None)
    ap.add_argument("--gemm-tflops", type=float, default=760.0,
                    help="--profile: the matmul ceiling for the floor (bf16 8192^3 on an H200, bench/RESULTS.md)")
    ap.add_argument("--hbm-tbps", type=float, default=4.26,
                    help="--profile: HBM bandwidth for the optimizer's floor (bench_optimizer.py's copy on an H200)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--attention", default="auto", help="preferred SDPA kernel: auto, cudnn, flash, efficient; "
                    "fa4: the causal core by FlashAttention-4 (megaloom/fa4.py)")
    ap.add_argument("--document-mask", type=int, default=0, metavar="LEN",
                    help="packed documents of LEN tokens kept apart (data.document_mask; FlexAttention on GPUs)")
    ap.add_argument("--no-grouped-mm", action="store_true", help="MoE: per-expert loop instead of torch._grouped_mm")
    ap.add_argument("overrides", nargs="*", help="extra model.* overrides")
    args = ap.parse_args()

    device = torch.device(args.device)
    if args.no_grouped_mm:
        import megaloom.models.moe as moe

        moe.USE_GROUPED_MM = False
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    cfg = load_config(None, [f"model.preset={args.preset}", f"train.seq_len={args.seq_len}",
                             f"model.max_seq_len={max(args.seq_len, 8192)}", *args.overrides])
    t = cfg.train  # the command line's training options, applied to the model exactly as `megaloom train` does
    t.precision, t.fp8_recipe, t.fp8_keep_first_last = args.precision, args.fp8_recipe, args.fp8_keep_first_last
    t.fp8_fast_accum, t.fp8_keep_attention = args.fp8_fast_accum, args.fp8_keep_attention
    t.fp8_experts = args.fp8_experts and args.precision == "fp8"
    t.recompute, t.recompute_layers, t.fused_loss = args.recompute, args.recompute_layers, args.fused_loss
    t.attention = args.attention
    if t.bf16_residual == "auto":  # as `megaloom train` chooses it on this device (levers.py)
        t.bf16_residual = next(c.value for c in choose_levers(cfg, device.type) if c.key == "train.bf16_residual")
    torch.manual_seed(0)
    model = build_on_device(cfg.model, device)
    # As the trainer: selective recompute re-runs the attention core only under the math kernel.
    kernel = attention_backend(cfg, device.type)
    fp8_summary = apply_train_options(model, t, loss_chunk=args.loss_chunk or None,
                                      recompute_attention=kernel == "math", device=device)
    if fp8_summary is not None:
        print(fp8_summary, flush=True)
    if args.compile:
        set_lean_saves(args.recompute_casts)
        for k, layer in model.layers.items():
            model.layers[k] = torch.compile(layer)
    optimizer = build_optimizer(model, cfg.train, device)
    documents = None
    if args.document_mask:
        from functools import partial

        from megaloom.models.documents import Documents

        documents = partial(Documents.from_tokens, eod_id=0)  # token 0 ends a document (written below)
    step = TrainStep(model, optimizer, args.precision, device, args.micro_batch, grad_clip=1.0,
                     attention=args.attention, offload=args.offload, documents=documents,
                     overlap_optimizer=args.overlap_optimizer)

    gbs = args.micro_batch * args.grad_accum
    tokens_per_step = gbs * args.seq_len
    fpt = flops_per_token(cfg.model, matmul_params(model), args.seq_len)
    peak = device_peak_flops(device) or 989e12
    times, losses = [], []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    batches = []
    for i in range(args.steps):
        batch = torch.randint(1, cfg.model.vocab_size, (gbs, args.seq_len + 1), device=device)
        if args.document_mask:
            batch[:, args.document_mask - 1::args.document_mask] = 0
        if args.window and i >= args.warmup:
            batches.append(batch)  # timed below, back to back
            continue
        sync()
        t0 = time.perf_counter()
        out = step(batch)
        sync()
        dt = time.perf_counter() - t0
        times.append(dt)
        losses.append(out.loss.item())
        print(f"step {i + 1}: {dt * 1e3:.1f} ms, {tokens_per_step / dt:,.0f} tok/s, loss {losses[-1]:.3f}",
              flush=True)
    if batches:  # --window: no host sync between the timed steps; their mean time
        sync()
        t0 = time.perf_counter()
        outs = [step(b) for b in batches]
        sync()
        dt = (time.perf_counter() - t0) / len(batches)
        times = [dt] * len(batches)
        losses += [o.loss.item() for o in outs]
        print(f"steps {args.warmup + 1}-{args.steps} back to back: {dt * 1e3:.1f} ms a step, "
              f"{tokens_per_step / dt:,.0f} tok/s", flush=True)
    use = times if batches else (times[args.warmup:] or times)
    tps = tokens_per_step / statistics.median(use)
    n_params = sum(p.numel() for p in model.parameters())
    row = {
        "run_id": args.run_id or datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%S"),
        "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "framework": "megaloom",
        "model": args.preset,
        "params": n_params,
        "seq_len": args.seq_len,
        "micro_batch": args.micro_batch,
        "grad_accum": args.grad_accum,
        "precision": args.precision,
        "fp8_recipe": args.fp8_recipe if args.precision == "fp8" else None,
        "fp8_keep_first_last": args.fp8_keep_first_last if args.precision == "fp8" else None,
        "fp8_fast_accum": args.fp8_fast_accum if args.precision == "fp8" else None,
        "fp8_keep_attention": args.fp8_keep_attention if args.precision == "fp8" else None,
        "fp8_experts": t.fp8_experts if args.precision == "fp8" else None,
        "compile": args.compile,
        "fused_loss": args.fused_loss,
        "loss_chunk": (args.loss_chunk or None) if args.fused_loss else None,
        "grouped_mm": not args.no_grouped_mm,
        "attention": args.attention,
        "active_params_matmul": matmul_params(model),
        "recompute": args.recompute, "recompute_layers": args.recompute_layers,
        "recompute_casts": args.recompute_casts, "overlap_optimizer": args.overlap_optimizer,
        "bf16_residual": t.bf16_residual,
        "timing": "window mean" if args.window else "median step", "offload": args.offload,
        "document_mask": args.document_mask or None,
        "tokens_per_s": round(tps),
        "mfu": round(fpt * tps / peak, 4),
        "flops_per_token": fpt,
        "peak_mem_gb": round(torch.cuda.max_memory_allocated() / 2**30, 2) if device.type == "cuda" else None,
        "peak_reserved_gb": round(torch.cuda.max_memory_reserved() / 2**30, 2) if device.type == "cuda" else None,
        "step_ms_median": round(1e3 * statistics.median(use), 2),
        "final_loss": losses[-1],
        "commit": git_commit(),
    }
    if args.profile:
        from profile_breakdown import floor_ms, profile_step, table

        batch = torch.randint(1, cfg.model.vocab_size, (gbs, args.seq_len + 1), device=device)
        if args.document_mask:
            batch[:, args.document_mask - 1::args.document_mask] = 0
        b = profile_step(lambda: step(batch), Path(args.profile), device.type, moe=cfg.model.moe_every > 0)
        passes = 8 if args.recompute == "full" else 6  # forward, backward (2x), and the recomputed forward
        gemm_kinds = {k: v for k, v in b["kinds_ms"].items() if "gemm" in k.lower()}  # dense + grouped
        floor = floor_ms({"attention": b["kinds_ms"].get("attention", 0.0)},
                         gemm_flop=passes * matmul_params(model) * tokens_per_step, gemm_tflops=args.gemm_tflops,
                         optimizer_bytes=32 * n_params, hbm_tb_per_s=args.hbm_tbps)
        b["floor_ms"] = {**floor, "gemm_kinds_measured_ms": sum(gemm_kinds.values())}
        print(table(b, row["step_ms_median"], floor), flush=True)
        row["profile"] = b
    print("RESULT " + json.dumps(row), flush=True)
    if args.results:
        with open(args.results, "a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
