"""Dry runs on a fake process group that returns garbage, as a GPU's does (tests/garbage_group.py).

On a CPU, torch's fake group often leaves zeros or the sender's own bytes in a receive buffer, so a dry run that
reads a peer's answer on the host passed here and died on the GPU (the guard's node-name gather unpickled
garbage; the MoE dispatch's split sizes came out negative). Here every such read raises or goes negative, so the
class of defect fails on CPU too. One fresh process runs every case (a process group is process-global).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SMALL = ["train.micro_batch_size=1", "train.seq_len=64"]
CASES = {
    # dense, tp x pp x dp with the resilience guard's control group (save_on_signal) and interleaving
    "dense tp2 pp2 vpp2": ["parallel.tp=2", "parallel.pp=2", "parallel.vpp=2", "parallel.schedule=interleaved",
                           "train.global_batch_size=64", *SMALL],
    # MoE over ep alone (AllToAllDispatcher) and ep with tp + sp (SequenceShardDispatcher: counts gathered over tp)
    "moe ep4": ["model.preset=mixtral-tiny", "parallel.ep=4", "train.global_batch_size=64", *SMALL],
    "moe ep4 tp2 sp": ["model.preset=mixtral-tiny", "parallel.ep=4", "parallel.tp=2", "parallel.sp=true",
                       "train.global_batch_size=32", *SMALL],
    "mla moe ep2": ["model.preset=deepseek-v3-tiny", "parallel.ep=2", "train.global_batch_size=64", *SMALL],
    "cp2 tp2": ["parallel.cp=2", "parallel.tp=2", "train.global_batch_size=16", *SMALL],
}

SCRIPT = """
import json, sys
sys.path.insert(0, {tests!r})
import garbage_group
garbage_group.install()
import torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

# the patch itself bites: an object exchange raises, an integer receive is garbage
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
try:
    dist.all_gather_object([None] * 4, "x")
    print("RESULT" + json.dumps(["self-test", "object exchange did not raise"]))
except Exception as e:
    counts = torch.zeros(4, dtype=torch.long)
    dist.all_to_all_single(counts, torch.ones(4, dtype=torch.long))
    ok = "invalid load key" in str(e) and counts.tolist() == [garbage_group.GARBAGE] * 4
    print("RESULT" + json.dumps(["self-test", "ok" if ok else f"patch did not bite: {{counts.tolist()}}"]))
dist.destroy_process_group()

from megaloom.config import load_config
from megaloom.training.dryrun import dry_run
for name, over in {cases!r}.items():
    try:
        r = dry_run(load_config(None, over), 64, "0", steps=1)
        print("RESULT" + json.dumps([name, "ok" if r.losses else "no step ran", r.table()]))
    except Exception as e:
        print("RESULT" + json.dumps([name, f"{{type(e).__name__}}: {{e}}"]))
"""


@pytest.mark.slow
def test_dry_runs_read_nothing_from_a_fake_group() -> None:
    code = SCRIPT.format(tests=str(ROOT / "tests"), cases=CASES)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600,
                         cwd=ROOT)
    results = {r[0]: r[1:] for r in (json.loads(x[len("RESULT"):]) for x in out.stdout.splitlines()
                                     if x.startswith("RESULT"))}
    assert set(results) == {"self-test", *CASES}, out.stderr[-3000:]
    failed = {k: v[0] for k, v in results.items() if v[0] != "ok"}
    assert not failed, failed
    # the report says the routing it assumed wherever experts are spread over ranks, and only there
    for name in CASES:
        expert_parallel = any(o.startswith("parallel.ep=") for o in CASES[name])
        assert ("balanced routing" in results[name][1]) == expert_parallel, name
