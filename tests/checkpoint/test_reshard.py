"""A checkpoint saved under one parallel layout resumes under others (CPU, gloo, world 8): the losses of the
following steps equal the uninterrupted single-process run's."""

import json
import subprocess
import sys

from megaloom.config import load_config
from megaloom.train import train
from tests.conftest import tiny_overrides

# warmup (5 steps, from tiny_overrides) covers the source run's 3 steps, so its learning rates equal the 5-step runs'.
BASE = ["model.n_layers=4", "train.global_batch_size=16", "train.micro_batch_size=2", "train.steps=5",
        "checkpoint.every=3", "train.grad_clip=0.5", "data.num_workers=0"]


def losses(run_dir):
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        out[r["step"]] = r["loss"]
    return out


def torchrun(args):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "8", "-m", "megaloom",
           "train", *args]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    return p.stdout


def test_save_tp2_pp2_dp2_resume_under_other_layouts(small_corpus, tmp_path):
    ref = train(load_config(None, tiny_overrides(small_corpus, tmp_path / "ref", *BASE)))
    src = tmp_path / "src"
    torchrun(tiny_overrides(small_corpus, src, *BASE, "parallel.tp=2", "parallel.pp=2", "train.steps=3"))
    ckpt = src / "checkpoints" / "step_00000003"
    layouts = {"pp4": ["parallel.pp=4"], "tp4z1": ["parallel.tp=4", "parallel.zero=1"]}
    for name, layout in layouts.items():
        out = torchrun(tiny_overrides(small_corpus, tmp_path / name, *BASE, *layout, f"checkpoint.resume={ckpt}"))
        assert "resumed from" in out
        got = losses(tmp_path / name)
        for step in (4, 5):
            assert abs(got[step] - ref.losses[step]) <= 1e-5 * ref.losses[step], (name, step, got[step])
    single = train(load_config(None, tiny_overrides(small_corpus, tmp_path / "one", *BASE,
                                                    f"checkpoint.resume={ckpt}")))
    for step in (4, 5):
        assert abs(single.losses[step] - ref.losses[step]) <= 1e-5 * ref.losses[step], step
