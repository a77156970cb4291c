"""Build time and per-rank resident memory of the sample index for a synthetic corpus (no real tokens).

    python bench/bench_data_index.py --tokens 1e12 --seq-len 4096 --docs 1e7 [--datasets 1] [--dir /tmp/x]

The token file is sparse (``truncate``: a 2 TB ``.bin`` takes no disk), the ``.idx`` real (``--docs`` documents of
equal length). Three fresh processes, as three ranks would: the builder (rank 0: shuffles and writes the index
to the cache), a loader (any other reading rank: memory-maps the cached index, reads 100 samples' tokens) and a
middle pipeline stage (loads nothing). Each reports wall time and its peak and final resident set from
/proc/self/status (VmHWM, RssAnon: private memory; RssFile: pages of mapped files, shared by every process on
the node and reclaimable). Prints one JSON line per role.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def make_corpus(prefix: Path, n_tokens: int, n_docs: int, vocab: int = 256) -> None:
    from megaloom.data.indexed import HEADER, MAGIC, VERSION

    prefix.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{prefix}.bin", "wb") as f:
        f.truncate(n_tokens * 2)  # uint16 tokens, sparse: reads give zeros
    offsets = np.linspace(0, n_tokens, n_docs + 1).astype("<i8")
    with open(f"{prefix}.idx", "wb") as f:
        f.write(HEADER.pack(MAGIC, VERSION, 1, vocab, n_docs))
        for lo in range(0, n_docs + 1, 1 << 24):
            f.write(offsets[lo:lo + (1 << 24)].tobytes())


def memory() -> dict:
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
            fields[key] = int(value.split()[0]) * 1024
    return fields


def role(name: str, prefixes: list[str], n_train: int, seq_len: int, cache: str) -> dict:
    from megaloom.config import DataConfig
    from megaloom.data.dataset import build_datasets
    from megaloom.data.tokenizer import train_bpe

    tok = Path(cache) / "tok.json"
    Path(cache).mkdir(parents=True, exist_ok=True)
    if not tok.exists():
        (Path(cache) / "t.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 50)
        train_bpe([Path(cache) / "t.txt"], 300, tok, show_progress=False)
    cfg = DataConfig(paths=prefixes, tokenizer=str(tok), split="100,0", cache_dir=cache, num_workers=0)
    before = memory()
    t0 = time.perf_counter()
    train, _, _ = build_datasets(cfg, seq_len, seed=1, n_train=n_train, n_valid=0, reads_data=name != "middle")
    seconds = time.perf_counter() - t0
    if name != "middle":
        step = max(1, n_train // 100)
        for i in range(0, n_train, step):  # a few samples' tokens, read lazily through the maps
            train[i]
    return {"role": name, "seconds": seconds, "before": before, "after": memory()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=float, default=1e12)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--docs", type=float, default=1e7)
    p.add_argument("--datasets", type=int, default=1)
    p.add_argument("--dir", default="/tmp/megaloom-bench-index")
    p.add_argument("--role", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    root = Path(args.dir)
    n_tokens, n_docs = int(args.tokens), int(args.docs)
    per = n_tokens // args.datasets
    prefixes = [str(root / f"corpus{d}") for d in range(args.datasets)]
    n_train = (n_tokens - args.datasets) // args.seq_len  # one epoch of the whole corpus
    if args.role:
        print("ROW" + json.dumps(role(args.role, prefixes, n_train, args.seq_len, str(root / "cache"))))
        return 0
    for prefix in prefixes:
        make_corpus(Path(prefix), per, n_docs // args.datasets)
    for name in ("builder", "loader", "middle"):
        cmd = [sys.executable, __file__, "--role", name, "--tokens", str(args.tokens), "--seq-len",
               str(args.seq_len), "--docs", str(args.docs), "--datasets", str(args.datasets), "--dir", args.dir]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
        row = json.loads(next(x for x in out.stdout.splitlines() if x.startswith("ROW"))[3:])
        row.update(tokens=n_tokens, docs=n_docs, seq_len=args.seq_len, samples=n_train, datasets=args.datasets)
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
