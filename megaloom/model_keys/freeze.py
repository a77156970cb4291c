"""What trains frozen (megaloom/models/freeze.py): the parts of a multimodal model, or the language model."""

from __future__ import annotations

from dataclasses import dataclass

from megaloom.model_keys.base import _f


@dataclass
class FreezeKeys:
    freeze: list[str] = _f([], "Parts trained frozen (no gradients, no optimizer state, skipped by the gradient "
                               "reduction): any of vision, projector, language; e.g. vision,language = LLaVA's "
                               "projector-only pretraining.")
