"""bench/onebit_simulate.py: 1-bit Adam over 4 data-parallel ranks simulated in one process with megaloom's own
optimizer and compression code, against the tests' independent dp-4 simulation written from the papers
(tests/parallel/dp/onebit_worlds.py; test_dp_world4.py holds that one to a real gloo dp4 world step by step).

Clipped (the convergence runs clip at 1.0), 4 warm-up steps and 6 compressed ones agree to float32 rounding. A
1-bit sign is a discontinuous function of its value: two free runs part for good where a value within rounding
of zero takes the other sign (the world test reloads its reference every step for that reason); unclipped that
happens in the second compressed step on this model, so there only the warm-up and the first compressed step are
compared."""

from __future__ import annotations

import copy
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from onebit_simulate import SimulatedOnebitAdam  # noqa: E402

from megaloom.config import load_config  # noqa: E402
from megaloom.parallel.mesh import Mesh  # noqa: E402
from tests.parallel.dp.dp_worlds import BETAS, BUCKET_MB, GLOBAL_BATCH, LR, WD, base_model, global_batches  # noqa: E402
from tests.parallel.dp.onebit_worlds import REFRESH, WARMUP, WINDOW, Simulation  # noqa: E402


@pytest.mark.parametrize("clip,steps,refresh", [(0.05, 10, 0), (math.inf, WARMUP + 1, 0), (0.05, 10, REFRESH)])
def test_the_one_process_simulation_follows_the_papers_dp4_steps(clip: float, steps: int, refresh: int) -> None:
    """(``refresh``: 0/1 Adam's variance steps, train.onebit_variance_updates, at steps 6 and 8.)"""
    mesh = Mesh.single(torch.device("cpu"))
    base = base_model("llama", mesh)
    t = load_config(None, ["train.optimizer=onebit_adam", f"train.lr={LR}", f"train.beta1={BETAS[0]}",
                           f"train.beta2={BETAS[1]}", f"train.weight_decay={WD}", f"train.onebit_warmup_steps={WARMUP}",
                           f"train.onebit_variance_window={WINDOW}",
                           f"train.grad_clip={clip if math.isfinite(clip) else 0}",
                           f"train.onebit_variance_updates={refresh}"]).train
    model = copy.deepcopy(base)
    ours = SimulatedOnebitAdam(model, t, 4, BUCKET_MB)
    paper = Simulation(base, mesh, 4, "onebit_adam", clip, refresh=refresh)
    theirs = dict(paper.model.named_parameters())
    micro = GLOBAL_BATCH // 4 // 2
    for step, batch in enumerate(global_batches()[:steps]):
        loss, _ = ours.step(batch, micro)
        assert abs(loss - paper.step(batch, micro)) <= 1e-6 * abs(loss), step
        err = max((p - theirs[n]).abs().max().item() for n, p in model.named_parameters())
        assert err <= 4 * torch.finfo(torch.float32).eps, (step, err)  # weights ~0.1-1: a few roundings
    assert ours.opt.steps == steps and ours.opt.compressing() != (refresh and steps + 1 in paper.refreshes)
