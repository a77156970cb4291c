"""train.attention=fa4: FlashAttention-4 (the `flash-attn-4` package, CuTe DSL kernels for Hopper and Blackwell)
behind PyTorch's own SDPA.

PyTorch's flash-attention registry (`torch.nn.attention.activate_flash_attention_impl("FA4")`) re-points the aten
flash-attention ops (forward and backward) at FA4's kernels on CUDA; SDPA, autograd and torch.compile then run it
as they run the built-in flash kernel, so the model code does not change: the step prefers SDPA's flash backend
(`step.attention_ctx`). Nothing is written by hand here: the kernels are FA4's, the dispatch is PyTorch's.
The registration is process-wide, as the kernel priority flags are; it is done once, before the first step.
"""

from __future__ import annotations

import torch

from megaloom.config import ConfigError

_active = False


def fa4_problem(device: torch.device) -> str | None:
    """Why train.attention=fa4 cannot run on ``device`` (None: it can). Cheap: an import and a capability read."""
    if device.type != "cuda":
        return "it needs a CUDA GPU"
    major, minor = torch.cuda.get_device_capability(device)
    if major not in (9, 10):
        return f"FA4 runs on compute capability 9.0 or 10.x, this GPU is {major}.{minor}"
    try:
        from torch.nn.attention import activate_flash_attention_impl  # noqa: F401
    except ImportError:
        return f"this torch ({torch.__version__}) has no flash-attention registry (activate_flash_attention_impl)"
    try:
        import flash_attn.cute.interface  # noqa: F401
    except ImportError as e:
        return f"the flash-attn-4 package is not importable ({e}); pip install flash-attn-4"
    return None


def enable_fa4(device: torch.device) -> None:
    """Register FA4 as the implementation of PyTorch's flash attention ops (once per process)."""
    global _active
    if _active:
        return
    problem = fa4_problem(device)
    if problem is not None:
        raise ConfigError(f"train.attention=fa4: {problem}. Use train.attention=cudnn (or auto).")
    from torch.nn.attention import activate_flash_attention_impl

    activate_flash_attention_impl("FA4")
    _active = True
