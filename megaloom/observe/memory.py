"""Peak memory in GB: the accelerator's caching allocator's peak, or the process's peak RSS on CPU."""

from __future__ import annotations

import resource
import sys

import torch

from megaloom import accelerator


def peak_memory_gb(device: torch.device) -> float:
    if accelerator.is_accelerator(device):
        return accelerator.max_memory_allocated(device) / 1e9
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / (1e9 if sys.platform == "darwin" else 1e6)
