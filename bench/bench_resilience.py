"""What the fault machinery's per-rank bookkeeping costs at the scale of a large job, on one CPU core.

- straggler check: the medians of the other ranks for every rank (`straggler.medians_of_others`), against the
  loop it replaced (one `statistics.median` of the other n - 1 values per rank: n^2 log n);
- doctor: the verdict table (`doctor.verdicts`, 4 columns and a failed flag per rank), against the old loop;
- `megaloom status`: reading and formatting n ranks' heartbeat files (`observe.heartbeat.status_table`).

    python bench/bench_resilience.py [--worlds 1024 8192] [--old-up-to 1024]

The old loops are timed only up to --old-up-to ranks (at 8,192 they take seconds to minutes).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from megaloom.observe.heartbeat import status_table  # noqa: E402
from megaloom.resilience.doctor import verdicts  # noqa: E402
from megaloom.resilience.straggler import slower_than_others  # noqa: E402

KEYS = ["matmul_s", "all_reduce_s", "all_gather_s", "p2p_s"]


def old_stragglers(times: list[float], factor: float) -> list[int]:
    """The replaced loop (megaloom before issue 19), kept here only as the reference to time against."""
    slow = []
    for r, t in enumerate(times):
        median = statistics.median(times[:r] + times[r + 1:])
        if median > 0 and t > factor * median:
            slow.append(r)
    return slow


def old_verdicts(rows: list[list[float]], factor: float) -> list[str]:
    out = []
    for r, row in enumerate(rows):
        others = [o for j, o in enumerate(rows) if j != r and not o[-1]]
        medians = [statistics.median(o[i] for o in others) if others else 0.0 for i in range(len(KEYS))]
        bad = [k for i, k in enumerate(KEYS) if medians[i] > 0 and row[i] > factor * medians[i]]
        out.append("FAILED" if row[-1] else (f"SLOW: {', '.join(bad)}" if bad else "ok"))
    return out


def best_of(fn, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[1024, 8192])
    ap.add_argument("--old-up-to", type=int, default=1024)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    rows = []
    for n in args.worlds:
        times = 1 + 0.01 * rng.random(n)
        times[n // 3] = 3.0
        table = np.column_stack([times] * 4 + [np.zeros(n)])
        row = {"world": n,
               "straggler_s": best_of(lambda t=times: slower_than_others(t, 1.5)),
               "doctor_s": best_of(lambda t=table: verdicts(t, KEYS, 2.0))}
        assert np.flatnonzero(slower_than_others(times, 1.5)).tolist() == [n // 3]
        if n <= args.old_up_to:
            row["straggler_old_s"] = best_of(lambda t=times.tolist(): old_stragglers(t, 1.5), 1)
            row["doctor_old_s"] = best_of(lambda t=table.tolist(): old_verdicts(t, 2.0), 1)
            assert old_stragglers(times.tolist(), 1.5) == [n // 3]
            assert old_verdicts(table.tolist(), 2.0) == verdicts(table, KEYS, 2.0)
        with tempfile.TemporaryDirectory() as d:
            hb = Path(d) / "heartbeat"
            hb.mkdir()
            now = time.time()
            for r in range(n):
                (hb / f"rank{r}.json").write_text(json.dumps({
                    "rank": r, "step": 1000, "time": now, "pid": 1000 + r, "op_count": 123456, "every_s": 10.0,
                    "last_op": "collective #123456 all_reduce_sum over ranks [0, 1, 2, 3, 4, 5, 6, 7]: returned"}))
            row["status_s"] = best_of(lambda d=d: status_table(d))
        rows.append(row)
        print(json.dumps({k: (round(v, 5) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)


if __name__ == "__main__":
    main()
