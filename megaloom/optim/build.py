"""Optimizer construction and the learning-rate schedule (linear warmup, cosine decay to min_lr)."""

from __future__ import annotations

import math

import torch
from torch import nn

from megaloom import accelerator
from megaloom.config import TrainConfig
from megaloom.optim.lamb import build_lamb
from megaloom.optim.param_groups import param_groups


def build_optimizer(model: nn.Module, cfg: TrainConfig, device: torch.device, mesh=None) -> torch.optim.Optimizer:
    """AdamW, LAMB or Muon over whole (possibly tensor-parallel) parameters; ZeRO uses parallel.zero's
    optimizer."""
    if cfg.optimizer == "lamb":
        return build_lamb(model, cfg.weight_decay, cfg.lr, (cfg.beta1, cfg.beta2), eps=1e-6, mesh=mesh)
    # The fused kernel on an accelerator torch has it for (one launch for all parameters); foreach on CPU.
    fused = accelerator.fused_optimizer(device)
    if cfg.optimizer == "muon":
        from megaloom.optim.muon import build_muon  # muon.py builds on zero.py, which needs nothing of this module
        from megaloom.parallel.mesh import Mesh

        return build_muon(model, mesh if mesh is not None else Mesh.single(device), cfg.lr, cfg.weight_decay,
                          (cfg.beta1, cfg.beta2), cfg.muon_momentum, cfg.muon_ns_steps, fused=fused)
    return torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                             eps=1e-8, fused=fused, foreach=None if fused else True)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate for optimizer step `step` (0-based): warmup to lr, then cosine down to min_lr."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    decay_steps = (cfg.lr_decay_steps or cfg.steps) - cfg.warmup_steps
    if decay_steps <= 0:
        return cfg.lr
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
