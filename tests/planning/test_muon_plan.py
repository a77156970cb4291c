"""The planner's Muon exchange (planning/comm.py `muon_bytes` / `muon_exchange`, planning/step.py
`muon_matrices`): the matrices are the blocks' matmul weights, the exchange's time is exposed in the step, and
Newton-Schulz joins the optimizer's time. That its bytes are the bytes a gloo world records:
tests/parallel/test_muon_world.py (`test_the_planner_counts_the_bytes_the_exchange_sends`)."""

from __future__ import annotations

import pytest

from megaloom.config import load_config
from megaloom.planning import comm
from megaloom.planning.hardware import load_gpu
from megaloom.planning.memory_params import analytic_params
from megaloom.planning.shape import shaped
from megaloom.planning.step import muon_matrices, predict

BASE = ["model.preset=llama3-8b", "parallel.tp=8", "train.seq_len=4096", "train.micro_batch_size=1",
        "train.global_batch_size=32", "model.n_layers=4", "parallel.zero=1"]


@pytest.mark.parametrize("tp", [1, 8, 16])  # 16 > 8 KV heads: the k / v pieces replicated over 2 tp ranks
def test_the_matrices_are_the_blocks_matmul_weights(tp):
    cfg = shaped(load_config(None, BASE))
    layers = list(range(cfg.model.n_layers))
    mats = muon_matrices(cfg, layers)
    whole = analytic_params(cfg, layers, False, False, 1, 1)
    assert sum(m.rows * m.cols * m.stack for m in mats) == sum(whole.matmul_layers.values())
    cfg.parallel.tp = tp
    local = muon_matrices(cfg, layers)
    kv = 2 * 4 * 1024 * 4096  # k and v of 4 layers: 8 KV heads of 128 over 4096
    extra = kv * (tp // 8 - 1) if tp > 8 else 0  # replicated pieces gathered again (tp / 8 copies of each)
    assert sum(m.local * tp for m in local) == sum(whole.matmul_layers.values()) + extra


def test_the_exchange_is_exposed_and_newton_schulz_joins_the_optimizer():
    gpu = load_gpu("h100-sxm")
    adam, muon = (predict(shaped(load_config(None, [*BASE, f"train.optimizer={o}"])), 32, gpu, memory=False)
                  for o in ("adamw", "muon"))
    assert "muon" not in adam.exposed and muon.exposed["muon"] > 0
    cfg = shaped(load_config(None, [*BASE, "train.optimizer=muon"]))
    mats = muon_matrices(cfg, list(range(4)))
    sizes = muon.sizes
    want, ns = comm.muon_exchange(mats, 8, sizes["dp"], 1, 1, comm.link_of(gpu, sizes, "tp"),
                                  comm.link_of(gpu, sizes, "dp"), comm.link_of(gpu, sizes, "dp"),
                                  gpu.peak_tflops * 1e12)
    assert muon.exposed["muon"] == pytest.approx(want)
    assert muon.optimizer_s == pytest.approx(adam.optimizer_s + ns)
    assert muon.step_s == pytest.approx(adam.step_s + want + ns, rel=1e-9)
    dry = predict(shaped(load_config(None, [*BASE, "train.optimizer=muon"])), 32, gpu, mode="dry-run",
                  memory=False)
    assert "muon" not in dry.exposed  # the fake group: collectives free, Newton-Schulz still computed


def test_bytes_without_zero_gather_on_every_replica():
    mats = [comm.MuonMatrix(100, 20, 10), comm.MuonMatrix(50, 10, 5, tp_split=False)]
    z0 = comm.muon_bytes(mats, tp=2, dp=4, ep=1, zero=0)
    assert z0 == {("tp", "gather"): 4 * 100 * 2 * 8, ("tp", "scatter"): 4 * 100 * 2 * 8}
    z1 = comm.muon_bytes(mats, tp=2, dp=4, ep=1, zero=1)
    assert z1[("tp", "gather")] == 4 * 100 * 2 * 2  # only the owner's tp group
    assert z1[("dp", "reduce")] == z1[("dp", "broadcast")] == 4 * 150 * 8
