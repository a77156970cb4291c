"""What the HF interchange tests share: a converted run directory loaded as a megaloom model, and a transformers
model's logits."""

from __future__ import annotations

import torch

from megaloom.checkpoint.store import find_checkpoints, load_checkpoint, save_checkpoint
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


def saved_run(tmp_path, overrides: list[str], x: torch.Tensor, steps: int):
    """A run directory (``tmp_path / "run"``) holding a model-only checkpoint of a model of ``overrides`` after
    ``steps`` AdamW steps on tokens ``x`` (weights off their init, routers included), and that model in eval mode."""
    from megaloom.models import Transformer

    cfg = load_config(None, overrides)
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        model(x, x).backward()
        opt.step()
        opt.zero_grad()
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(cfg.to_yaml())
    save_checkpoint(run / "checkpoints", steps, model, None, {"model": cfg.model.__dict__}, keep=1)
    return run, model.eval()

