"""What train.* changes in the built model: fp8 linears, activation recomputation, the fused head + loss."""

from __future__ import annotations

import torch

from megaloom.config import TrainConfig
from megaloom.models import apply_recompute
from megaloom.models.attention import Attention
from megaloom.models.fused_ce import FusedHeadLoss
from megaloom.precision.fp8_convert import convert_to_float8


def mtp_loss_weight_at(step: int, t: TrainConfig) -> float:
    """Multi-token prediction's loss weight at optimizer step ``step`` (1-based): train.mtp_loss_weight, then
    train.mtp_loss_weight_late from train.mtp_late_step on (DeepSeek-V3's 0.3, then 0.1)."""
    late = t.mtp_loss_weight_late >= 0 and step >= t.mtp_late_step
    return t.mtp_loss_weight_late if late else t.mtp_loss_weight


def apply_train_options(model: torch.nn.Module, t: TrainConfig, loss_chunk: int | None = None,
                        recompute_attention: bool = True, device: torch.device | None = None):
    """What train.* changes in the built (tensor-parallel) model before pipeline stages and compile: the blocks'
    linears in float8 (precision=fp8; tp collectives stay bf16), activation recomputation, and the fused
    head + loss (validate() refuses it with tp > 1). Shared with bench/bench_train.py, so that what is measured is
    what trains. ``loss_chunk``: tokens per fused-loss chunk (None: the default). ``recompute_attention``: selective
    recompute includes the attention core (only worth it for the math kernel: `apply_recompute`). ``device``: where
    the model will train (it may still be on the meta device), for the choice of fp8 GEMM backend. Returns the fp8
    summary or None."""
    summary = None
    if t.precision == "fp8":
        summary = convert_to_float8(model, t.fp8_recipe, t.fp8_keep_first_last, t.fp8_fast_accum,
                                    t.fp8_keep_attention, experts=t.fp8_experts, device=device)
    apply_recompute(model, t.recompute, t.recompute_layers or None, core_attention=recompute_attention)
    # Under autocast only (Transformer.embed checks): the cast has no effect on an fp32 run.
    # train.bf16_params: the embedding's weight is bf16, so the fp32 stream (without bf16_residual) is cast to
    model.residual_dtype = torch.bfloat16 if t.bf16_residual is True else \
        torch.float32 if getattr(t, "bf16_params", False) is True else None
    for module in model.modules():  # train.attention=fa4: the causal core by FlashAttention-4 (megaloom.fa4)
        if isinstance(module, Attention):
            module.fa4 = t.attention == "fa4"
    if t.fused_loss is True:  # head + cross-entropy in chunks, never the full logits
        model.loss = FusedHeadLoss(loss_chunk)
    return summary

