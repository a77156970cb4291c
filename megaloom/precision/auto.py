"""train.precision=auto, decided in one place: bf16 on an accelerator, fp32 on the CPU.

The runtime (`megaloom.runtime.resolve_precision`, which adds the refusals of a precision the device cannot run),
the speed levers and the memory plan (`megaloom.planning`) all ask this function, so what a run computes in and what
the plan predicts for it cannot drift apart. It imports no torch of its own and nothing above the config.
"""

from __future__ import annotations

from megaloom import accelerator
from megaloom.config import Config


def compute_precision(cfg: Config, device: accelerator.Device) -> str:
    """train.precision with "auto" resolved: bf16 on any accelerator, fp32 on the CPU; any other value as set."""
    p = cfg.train.precision
    return ("bf16" if accelerator.is_accelerator(device) else "fp32") if p == "auto" else p
