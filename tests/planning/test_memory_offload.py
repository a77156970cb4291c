"""The memory plan with train.optimizer_offload: the device holds no optimizer state and no fp32 master, the host
line holds them (per rank: the masters, both moments and the gradients' landing buffer, 16 bytes per element of
the rank's share), and the measured host bytes of a built optimizer are that line."""

from __future__ import annotations

import torch

from megaloom.models.transformer import Transformer
from megaloom.optim.offload import build_offloaded
from megaloom.planning.memory_plan import plan_memory

from .test_memory_plan import _big


def test_offload_moves_the_moments_and_masters_off_the_device() -> None:
    z0 = plan_memory(_big("none"), device="cuda")
    off = plan_memory(_big("none", "train.optimizer_offload=true"), device="cuda")
    assert off.optimizer == 0 and z0.optimizer == 2 * z0.weights  # AdamW's two fp32 moments
    assert off.optimizer_host == 16 * (z0.weights // 4)  # per parameter: master, exp_avg, exp_avg_sq, gradient
    assert off.weights == z0.weights and off.gradients == z0.gradients
    assert off.peak == z0.peak - z0.optimizer  # every phase holds the state; the fused step has no temporaries
    assert off.checkpoint_host == 0 < z0.checkpoint_host  # the async save writes the host state in place
    assert "opt (host)" in off.table() and "opt (host)" not in z0.table()


def test_offload_under_zero_counts_each_ranks_shard_and_its_master() -> None:
    """ZeRO-1 gathering bf16 keeps an fp32 master shard beside the moments (12 bytes per shard element on the
    device); offloaded, all of it and the gradient buffer go to the host, per rank."""
    extra = ("train.global_batch_size=8", "parallel.zero=1", "train.bf16_params=false")  # the same weights
    z1 = plan_memory(_big("none", *extra), world_size=4, device="cuda")
    off = plan_memory(_big("none", *extra, "train.optimizer_offload=true"), world_size=4, device="cuda")
    shard = z1.optimizer // 12
    assert off.optimizer == 0 and off.optimizer_host == 16 * shard
    assert off.peak == z1.peak - z1.optimizer and off.build < z1.build  # no master shard built on the device


def test_the_plans_host_line_is_what_the_optimizer_holds() -> None:
    from megaloom.config import load_config

    cfg = load_config(None, ["model.preset=tiny", "model.vocab_size=256", "model.n_layers=2",
                             "train.optimizer_offload=true", "train.precision=fp32", "train.micro_batch_size=2"])
    model = Transformer(cfg.model)
    opt = build_offloaded(model, None, cfg.train, torch.device("cpu"))
    assert opt.host_bytes() == plan_memory(cfg, model=model, device="cpu").optimizer_host
