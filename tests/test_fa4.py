"""train.attention=fa4: refused before any heavy work where FlashAttention-4 cannot run, with the fix named.
(Its speed and loss on the H200: bench/RESULTS.md; the kernel itself is the flash-attn-4 package's.)"""

from __future__ import annotations

import pytest
import torch

from megaloom.config import ConfigError, load_config
from megaloom.fa4 import enable_fa4, fa4_problem
from megaloom.step import attention_ctx


def test_fa4_is_a_config_value():
    assert load_config(None, ["train.attention=fa4"]).train.attention == "fa4"


def test_fa4_refused_on_cpu_with_the_fix():
    assert "CUDA GPU" in fa4_problem(torch.device("cpu"))
    with pytest.raises(ConfigError, match="train.attention=fa4: it needs a CUDA GPU. Use train.attention=cudnn"):
        enable_fa4(torch.device("cpu"))


def test_fa4_leaves_cpu_attention_alone():
    with attention_ctx("fa4", torch.device("cpu")):  # the kernel preference applies to CUDA only
        q = torch.randn(1, 2, 8, 16)
        torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
