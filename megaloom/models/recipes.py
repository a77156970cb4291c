"""Training defaults that follow the model's size, for the published shapes (GPT-2 124M upwards).

One learning rate for every size is wrong: 3e-3 suits the 1.8M-parameter CPU preset and diverges a 1B model. The
rules below take a model's width, as the published recipes do, and set only what the user did not set (in the YAML
file or on the command line); the CPU-sized presets (d_model <= 256) keep the dataclass defaults.

- peak lr: 6e-4 up to d_model 768 (GPT-2/GPT-3 125M, nanoGPT), 3e-4 up to 4096 (GPT-3 350M-1.3B's 3e-4-2e-4,
  Llama 3 8B's 3e-4), 1.5e-4 above (Llama 3 70B); the minimum at the end of the cosine: lr / 10 (GPT-3, Llama).
- warmup: 700 steps up to d_model 768 (nanoGPT's 715), 2000 above (Llama 3: 2000 at 8B), at most a tenth of
  train.steps (a 600-step run still reaches its peak).
- init std: min(0.02, sqrt(2 / (5 d_model))) (the "small init" of Nguyen & Salazar 2019, GPT-NeoX): GPT-2's 0.02
  up to d_model 1000, 0.014 at 2048, 0.0099 at 4096; output projections keep their 1/sqrt(2 n_layers) factor.
"""

from __future__ import annotations

import math
from typing import Any

from megaloom.config import ModelConfig

CPU_SIZED = 256  # presets at or below this width keep the dataclass defaults (tuned for the CPU quick start)


def train_defaults(m: ModelConfig) -> dict[str, Any]:
    """{"section.key": value} defaults for a model of ``m``'s shape; empty for CPU-sized models. ``train.min_lr``
    is left to the caller (lr / 10 of whatever lr ends up set)."""
    d = m.d_model
    if d <= CPU_SIZED:
        return {}
    lr = 6e-4 if d <= 768 else 3e-4 if d <= 4096 else 1.5e-4
    return {"train.lr": lr, "train.warmup_steps": 700 if d <= 768 else 2000,
            "model.init_std": round(min(0.02, math.sqrt(2 / (5 * d))), 5)}
