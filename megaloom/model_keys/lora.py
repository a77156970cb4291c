"""The low-rank adapters' sub-section model.lora (megaloom/models/lora.py, which checks it)."""

from __future__ import annotations

from dataclasses import dataclass

from megaloom.model_keys.base import _f


@dataclass
class LoraConfig:
    """model.lora: low-rank adapters (Hu et al. 2021) on the blocks' linears; the base model trains frozen
    (megaloom/models/lora.py)."""

    rank: int = _f(0, "LoRA rank r; 0 = off. > 0: every base parameter is frozen (the language model's; other parts "
                      "follow model.freeze) and only the adapters A (r x in) and B (out x r) train: y = W x + "
                      "(alpha / r) B A x.")
    alpha: float = _f(16.0, "LoRA scale numerator: the adapters' output is multiplied by alpha / rank (PEFT's "
                            "lora_alpha).")
    targets: list[str] = _f(["q_proj", "k_proj", "v_proj", "o_proj"],
                            "The blocks' linears that get adapters, by the model's names: q_proj, k_proj, v_proj, "
                            "o_proj (attention), gate_proj, up_proj, down_proj (dense MLP; gate_proj only in gated "
                            "MLPs).")
    dropout: float = _f(0.0, "Dropout on the adapters' input (PEFT's lora_dropout).")


@dataclass
class LoraKeys:
    lora: LoraConfig = _f(LoraConfig(), "Low-rank adapters (model.lora.rank, .alpha, .targets, .dropout).")
