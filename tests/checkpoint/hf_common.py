"""What the HF interchange tests share: a converted run directory loaded as a megaloom model, and a transformers
model's logits."""

from __future__ import annotations

import torch

from megaloom.checkpoint.store import find_checkpoints, load_checkpoint
from megaloom.config import load_config
from megaloom.models.registry import get_family


def megaloom_from_run(run_dir):
    """The model of ``run_dir``'s newest checkpoint, built from its config.yaml (as `megaloom train --config`
    would), in eval mode, and that config."""
    cfg = load_config(run_dir / "config.yaml")
    model = get_family(cfg.model.arch).build(cfg.model)
    load_checkpoint(find_checkpoints(run_dir / "checkpoints")[0], model, None, model_cfg=cfg.model.__dict__)
    return model.eval(), cfg


def hf_logits(model, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(x).logits
