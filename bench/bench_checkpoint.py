"""Training-loop stall of a checkpoint: blocking save versus the two-stage async save, on one GPU.

Builds a preset's model and AdamW state on the GPU (one optimizer step so the state exists), then saves it
with `save_checkpoint` (the loop waits for the whole write) and with `AsyncCheckpointer` (the loop waits only
for the copy to pinned host memory; the write runs in a background thread).

    python bench/bench_checkpoint.py --preset llama3-1b --dir /tmp/ckpt-bench
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megaloom.checkpoint import AsyncCheckpointer, save_checkpoint  # noqa: E402
from megaloom.config import load_config  # noqa: E402
from megaloom.models import Transformer  # noqa: E402
from megaloom.optim.build import build_optimizer  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="llama3-1b")
    ap.add_argument("--dir", default="/tmp/megaloom-ckpt-bench")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    device = torch.device("cuda")
    cfg = load_config(None, [f"model.preset={args.preset}"])
    with torch.device("meta"):
        model = Transformer(cfg.model)
    model = model.to_empty(device=device)
    model.tie_weights()
    model.reset_parameters()
    opt = build_optimizer(model, cfg.train, device)
    x = torch.randint(0, cfg.model.vocab_size, (1, 129), device=device)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        model(x[:, :-1], x[:, 1:]).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    state_gb = (sum(p.numel() for p in model.parameters()) * 4 * 3) / 1e9
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    rows = []
    for i in range(args.repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        save_checkpoint(root / "blocking", i + 1, model, opt, {}, keep=1)
        rows.append({"mode": "blocking", "stall_s": time.perf_counter() - t0})
    saver = AsyncCheckpointer()
    for i in range(args.repeats):
        torch.cuda.synchronize()
        rec = saver.save(root / "async", i + 1, model, opt, {}, keep=1)
        time.sleep(0.5)  # "training" between saves; the next save waits for this write if it is still running
        rows.append({"mode": "async", "stall_s": rec.stall_s, "wait_s": rec.wait_s})
    last = saver.wait()
    rows.append({"mode": "async-write", "write_s": last.write_s if last else None})
    out = {"preset": args.preset, "gpu": torch.cuda.get_device_name(device), "torch": torch.__version__,
           "state_gb_fp32": round(state_gb, 2), "rows": rows}
    print("RESULT " + json.dumps(out), flush=True)
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
