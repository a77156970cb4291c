"""What a compiled block keeps for its backward: the lean-saves lever (train.recompute_casts).

AOTAutograd's partitioner decides which forward values a compiled block saves for backward and which it recomputes
there. By default it never recomputes a value that backward would have to materialise for a matmul
(`ban_recompute_materialized_backward`), so under bf16 autocast each block saves the bf16 copy of every weight
(the fp32 parameter is resident anyway), its norm outputs and the SwiGLU product. With the ban lifted it saves the
fp32 parameters (no new memory) and recomputes those cheap elementwise values in backward: llama3-8b at 8,192
tokens saves ~13 GiB of weight copies and a third of its activations less, for a few ms of casts per step.

The switch is torch's process-wide partitioner setting, read when a block compiles (its first call); megaloom sets
it once per process before the first compiled call, as `megaloom train` and bench/bench_train.py do. The same
values are computed either way: only where they live between forward and backward changes.
"""

from __future__ import annotations

import torch._functorch.config as functorch_config


def set_lean_saves(enabled: bool) -> None:
    """Let (True) or stop (False) compiled blocks recomputing matmul inputs in backward instead of saving them."""
    functorch_config.ban_recompute_materialized_backward = enabled is not True  # "auto" unresolved: off
