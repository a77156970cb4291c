"""Which SDPA kernel a run's attention core takes, and so which tensors it saves for backward.

The trainer asks it to decide whether selective recompute re-runs the attention core (only the math kernel keeps
the scores); the memory plan asks it for the save-set it counts. One function below both (training/ and planning/
never import each other for it), read from the config and the device alone.
"""

from __future__ import annotations

from megaloom.accelerator import compute_precision, is_cuda
from megaloom.config import Config
from megaloom.model_keys.shape import resolved_kv_heads


def attention_backend(cfg: Config, device: str, tp: int = 1) -> str:
    """Which SDPA save-set applies: "flash" (flash or cuDNN on GPU in bf16/fp16; the CPU flash kernel),
    "efficient" (GPU fp32 without grouped-query heads) or "math" (GPU fp32 with grouped-query heads, which
    the fused kernels do not take in fp32; train.attention=math; CPU with dropout; soft-capped scores,
    model.attn_softcap, which only the math path computes)."""
    m = cfg.model
    if getattr(m, "attn_softcap", 0.0):
        return "math"
    if is_cuda(device):
        if cfg.train.attention == "math":
            return "math"
        if compute_precision(cfg, device) == "fp32":
            kv = resolved_kv_heads(m)
            return "efficient" if m.n_heads // tp == max(kv // tp, 1) else "math"
        return "flash"
    return "math" if m.dropout > 0 else "flash"  # CPU's flash kernel has no dropout
