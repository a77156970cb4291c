"""LoRA in the parallel worlds (worlds.py, pipeline/zero_pp_worlds.py): the config, non-zero adapters, the frozen
base. Numbers only; the tests assert."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from megaloom.config import Config, LoraConfig
from megaloom.models.freeze import freeze_for_training
from megaloom.models.lora import is_adapter_name

# Every linear a dense block has: column-parallel (q, k, v, gate, up) and row-parallel (o, down) adapters both.
ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def with_lora(cfg: Config, rank: int = 4, alpha: float = 8.0) -> Config:
    """Adapters on every linear. (A larger alpha / rank makes each AdamW step move the effective weights by a
    large fraction of their size: rounding differences between layouts then grow past the worlds' 1e-5.)"""
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, lora=LoraConfig(rank, alpha, ALL_TARGETS)))


@torch.no_grad()
def randomize_adapters(model: nn.Module, seed: int = 7, std: float = 0.2) -> None:
    """B ~ N(0, std) instead of PEFT's zeros, so that A gets a gradient from the first step on (with B = 0 only B
    would train at step 1, and A's sharding would go untested until step 2)."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith(".lora_B.weight"):
            p.copy_(torch.randn(p.shape, generator=gen) * std)


def freeze_base(model: nn.Module, cfg: Config) -> None:
    """As the trainer does, after the model is split: only the adapters train."""
    freeze_for_training(model, cfg.model)


def base_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if not is_adapter_name(n)}


def base_changed(model: nn.Module, before: dict[str, torch.Tensor]) -> list[str]:
    """Base parameters that are not bit-identical to ``before`` (or that got a gradient): none with LoRA."""
    return [n for n, p in model.named_parameters()
            if n in before and (not torch.equal(p.detach(), before[n]) or p.grad is not None or p.requires_grad)]
