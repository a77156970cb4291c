"""Record one benchmark call: append its rows to bench/results.jsonl and print the table for RESULTS.md.

    python bench/record.py OUT_DIR [--results bench/results.jsonl] [--dry-run]

OUT_DIR is what `run_speed.sh` left in $OUT: ``results.jsonl`` (megaloom's rows from `bench_train.py`) and, when the
peer ran, ``peer_summary.jsonl`` (TorchTitan's runs, one line each, from ../shared/bench's summarize.py). Peer
lines are turned into rows of the same schema (``run_id``, ``date``, ``gpu``, ``torch`` and ``commit`` taken from
megaloom's rows of the same call, as both ran on one machine back to back). Rows already in the results file
(same run_id, framework, model, precision and micro-batch) are not appended twice. The table gives each row's
ratio to TorchTitan's best row of the same precision from the same call.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from megaloom.observe.metrics import read_jsonl  # noqa: E402

PEER = "torchtitan-0.2.2"
UNTIED_1B_PARAMS = 1_498_482_688  # the peer's "1B" flavor: llama3-1b-untied (../shared/bench/README.md)


def peer_rows(summaries: list[dict], like: dict, ours: list[dict] | None = None) -> list[dict]:
    """TorchTitan summary lines -> result rows, with the call's identity copied from a megaloom row ``like``.
    The sequence length comes from the log's name (``_s32k``: 32768; else 4096), and with it the FLOPs per token
    of megaloom's row of the same length in ``ours`` (summarize.py's MFU assumes 4096)."""
    rows = []
    for s in summaries:
        if s.get("err") or not s.get("tps"):
            continue
        fp8 = "fp8" in s["run"]
        seq, model = _seq_len(s["run"]), _model(s["run"])
        fpt = next((r["flops_per_token"] for r in ours or [] if r.get("seq_len") == seq and r.get("model") == model
                    and r.get("flops_per_token")), None)
        mfu = s["tps"] * fpt / 989e12 if fpt else s["mfu_titan_formula_989"] / 100
        rows.append({
            "run_id": like["run_id"], "date": like["date"], "gpu": like["gpu"], "torch": like.get("torch"),
            "framework": PEER, "model": model, "params": UNTIED_1B_PARAMS if model == "llama3-1b-untied" else None,
            "seq_len": seq,
            "micro_batch": _micro_batch(s["run"]), "precision": "fp8-tensorwise" if fp8 else "bf16",
            "compile": "compile" in s["run"], "tokens_per_s": s["tps"],
            "recompute": "selective" if "selective" in s["run"] else None,
            "mfu": round(mfu, 4), "peak_mem_gb": None,
            "peak_reserved_gb": s.get("mem_reserved_gib"), "commit": like.get("commit"), "run": s["run"]})
    return rows


def _model(run: str) -> str:
    """The megaloom preset a peer log ran the shape of: bench/titan_moe.py's moe-2.6B, the 8B flavor, else 1B."""
    return "qwen3-moe-2.6b" if "moe" in run else "llama3-8b" if "_8b" in run else "llama3-1b-untied"


def _micro_batch(run: str) -> int:
    """run_peers.sh names its logs ..._bs<N>.log; the long-sequence logs (``_s32k``) ran micro-batch 1."""
    m = re.search(r"_bs(\d+)", run)
    return int(m.group(1)) if m else (1 if _seq_len(run) != 4096 else 4)


def _seq_len(run: str) -> int:
    m = re.search(r"_s(\d+)k", run)
    return int(m.group(1)) * 1024 if m else 4096


def _key(r: dict) -> str:
    """A row's identity is all of it: a call recorded again adds nothing, while the rounds of an A/B that alternates
    the same configuration (run_speed.sh's bf16res, overlap) differ in their measurements and all land."""
    return json.dumps(r, sort_keys=True)


def table(rows: list[dict]) -> str:
    """Markdown: one line per row, with the ratio to the peer's best row of the same model, sequence length and
    precision (fp8 vs float8): TorchTitan's best setting, as the speed issue defines the race. Rows that are not
    training runs (bench_optimizer.py's) are left out."""
    rows = [r for r in rows if "framework" in r]
    peer: dict[tuple, int] = {}

    def kind_of(r: dict) -> tuple:
        return (r.get("model"), r.get("seq_len", 4096), "fp8" if "fp8" in r["precision"] else "bf16")

    for r in rows:
        if r["framework"] == PEER:
            peer[kind_of(r)] = max(peer.get(kind_of(r), 0), r["tokens_per_s"])
    lines = ["| framework | model | seq | precision | micro-batch | tokens/s | MFU | peak memory | vs TorchTitan |",
             "|---|---|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        kind = kind_of(r)
        ratio = f"{r['tokens_per_s'] / peer[kind]:.3f}x" if kind in peer else "–"
        mem = (f"{r['peak_mem_gb']} GB alloc" if r.get("peak_mem_gb") is not None
               else f"{r.get('peak_reserved_gb')} GiB reserved")
        lines.append(f"| {r['framework']} | {r['model']} | {r.get('seq_len', 4096)} | {r['precision']} | "
                     f"{r.get('micro_batch')} | "
                     f"{r['tokens_per_s']:,} | {100 * r['mfu']:.1f}% | {mem} | {ratio} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--results", type=Path, default=Path(__file__).parent / "results.jsonl")
    ap.add_argument("--dry-run", action="store_true", help="print the table, append nothing")
    args = ap.parse_args(argv)
    ours = [{k: v for k, v in r.items() if k != "profile"} for r in read_jsonl(args.out_dir / "results.jsonl")]
    if not ours:
        print(f"no megaloom rows in {args.out_dir / 'results.jsonl'}", file=sys.stderr)
        return 1
    rows = ours + peer_rows(read_jsonl(args.out_dir / "peer_summary.jsonl"), ours[0], ours)
    print(f"run {ours[0]['run_id']}, {ours[0]['date']}, {ours[0]['gpu']}, torch {ours[0].get('torch')}, "
          f"commit {ours[0].get('commit')}\n")
    print(table(rows))
    if not args.dry_run:
        have = {_key(r) for r in read_jsonl(args.results)}
        new = []
        for r in rows:  # once each, also within this call's files
            if _key(r) not in have:
                have.add(_key(r))
                new.append(r)
        with args.results.open("a") as f:
            for r in new:
                f.write(json.dumps(r) + "\n")
        print(f"\nappended {len(new)} rows to {args.results} ({len(rows) - len(new)} already there)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
