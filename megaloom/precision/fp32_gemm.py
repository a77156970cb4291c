"""Whether this device runs GEMMs of low-precision inputs with fp32 output, in place into an fp32 accumulator.

``torch.mm(a, b, out_dtype=torch.float32)`` and ``torch.addmm(c, a, b, out_dtype=torch.float32, out=c)`` for bf16
``a``, ``b``: the GEMM's epilogue reads and writes the fp32 accumulator, so a sum of products never passes through a
bf16 tensor and an fp32 add (CUDA in recent PyTorch). Used by the fused head + loss (`models/fused_ce.py`) and by
the weight gradients fused into the data-parallel buckets (`parallel/grad_fusion.py`); both fall back to the
product and an add where it is missing.
"""

from __future__ import annotations

import torch

_AVAILABLE: dict[str, bool] = {}


def fp32_out_gemm(device: torch.device) -> bool:
    """Probed once per device type, on tiny tensors."""
    if device.type not in _AVAILABLE:
        try:
            a = torch.ones(16, 16, device=device, dtype=torch.bfloat16)
            c = torch.mm(a, a, out_dtype=torch.float32)
            torch.addmm(c, a, a, out_dtype=torch.float32, out=c)
            _AVAILABLE[device.type] = bool(c.dtype == torch.float32 and c[0, 0].item() == 32.0)
        except (RuntimeError, TypeError, NotImplementedError):
            _AVAILABLE[device.type] = False
    return _AVAILABLE[device.type]
