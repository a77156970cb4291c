"""Start-up at scale: a rank's process-group creation calls do not grow with the world (the fake backend, one rank
of worlds of 64 to 1,024 ranks); before, every rank called dist.new_group for every group of the world."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAYOUT = ["model.preset=llama3-70b", "parallel.tp=8", "parallel.pp=4", "train.micro_batch_size=1"]

CODE = """
import json, sys
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from megaloom.config import load_config
from megaloom.parallel.mesh import Mesh, mesh_layout, validate_layout
from megaloom.parallel.pipeline.stage import build_embedding_groups
made = []
for name in ("new_group", "split_group"):  # every creation call a rank makes, whichever path it takes
    real = getattr(dist, name)
    setattr(dist, name, lambda *a, _real=real, **k: made.append(1) or _real(*a, **k))
for world, rank in json.loads(sys.argv[1]):
    cfg = load_config(None, json.loads(sys.argv[2]) + [f"train.global_batch_size={world}"])
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    made.clear()
    mesh = Mesh.build(cfg, world, rank, "cpu")
    pair = build_embedding_groups(mesh)
    layout = mesh_layout(world, validate_layout(cfg, world))
    print("ROW" + json.dumps({"world": world, "calls": len(made), "group_calls": mesh.group_calls,
          "groups": sum(map(len, layout.values())), "pp": mesh.pp_group.size(), "dp": mesh.dp_group.size(),
          "tp": mesh.tp_group.size(), "pair": None if pair is None else pair.size()}))
    dist.destroy_process_group()
"""


def _calls(cases: list[tuple[int, int]]) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", CODE, json.dumps(cases), json.dumps(LAYOUT)], capture_output=True,
                         text=True, env=env, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return [json.loads(x[3:]) for x in out.stdout.splitlines() if x.startswith("ROW")]


def test_group_creation_calls_do_not_grow_with_the_world() -> None:
    # tp 8 x pp 4: dp 2, 8, 32. The last rank is on a last pipeline stage; rank 8 on a middle one (pp rank 1).
    *ends, middle = _calls([(64, 63), (256, 255), (1024, 1023), (256, 8 * 8)])
    for r in ends:
        assert (r["tp"], r["pp"], r["dp"] * 32) == (8, 4, r["world"]) and r["pair"] == 2
        # Mesh.build: one call per distinct kind (tp, cp = ep, dp = dp_cp = edp, pp), one for the embedding pair.
        assert r["group_calls"] == 4 and r["calls"] == 5
    assert ends[-1]["groups"] > 1000  # the world has over a thousand groups; this rank made five calls
    assert ends[-1]["calls"] <= ends[0]["calls"] * 1024 / 64  # at most linear in the world (here: constant)
    assert middle["pair"] is None and middle["calls"] == 5
