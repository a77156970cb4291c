"""T5 (Raffel et al. 2020; Megatron-LM's T5Model): an encoder-decoder trained by span corruption.

Its module (`model.T5Model`) is a `Transformer` subclass with its own blocks (relative position buckets,
cross-attention, gated-GeLU); the objective (`spans.py`) turns each packed token row into an encoder input with
sentinels and a decoder target, from (seed, sample index) alone. Trains under data parallelism and ZeRO 1/2/3,
bf16, recomputation and checkpoints; tensor, pipeline and context parallelism are refused by name (see
spans.SpanCorruptionObjective.check and docs/architecture.md).

``TRAITS`` describe the stacks' blocks to the memory plan and FLOP counter, which model decoder-only blocks: for
t5 they are estimates (two stacks and cross-attention are not counted separately).
"""

from __future__ import annotations

from megaloom.config import ConfigError, ModelConfig
from megaloom.models.family import Family, Traits
from megaloom.models.t5.hf import HF
from megaloom.models.t5.model import T5Model
from megaloom.models.t5.presets import PRESETS
from megaloom.models.t5.spans import SpanCorruptionObjective

TRAITS = Traits(norm="rmsnorm", gated_mlp=True, bias=False, positions="relative", default_ffn_dim=lambda d: 4 * d,
                causal=False)


def validate(m: ModelConfig) -> None:
    kv = m.n_kv_heads or m.n_heads
    for key, value, ok, why in (
            ("model.n_kv_heads", kv, m.n_heads, f"T5 has multi-head attention: set it to 0 or {m.n_heads}"),
            ("model.parallel_block", m.parallel_block, False, "T5's blocks are sequential: set it to false"),
            ("model.sliding_window", m.sliding_window, 0, "T5 attends to the whole sequence: set it to 0"),
            ("model.moe_every", m.moe_every, 0, "no MoE T5 is built: set it to 0")):
        if value != ok:
            raise ConfigError(f"{key}={value} with model.arch=t5: {why}.")


class _T5Family(Family):
    def build(self, cfg: ModelConfig) -> T5Model:
        return T5Model(cfg, self)


FAMILY = _T5Family(name="t5", description="encoder-decoder, relative position buckets, span corruption (T5 v1.1)",
                   traits=TRAITS, plan={}, presets=PRESETS, hf=HF, validate=validate,
                   objective=SpanCorruptionObjective)
