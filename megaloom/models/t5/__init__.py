"""T5 (Raffel et al. 2020; Megatron-LM's T5Model): an encoder-decoder trained by span corruption.

Its module (`model.T5Model`) is a `Transformer` subclass with its own blocks (relative position buckets,
cross-attention, gated-GeLU); the objective (`spans.py`) turns each packed token row into an encoder input with
sentinels and a decoder target, from (seed, sample index) alone. Trains under tensor (+ sequence) parallelism,
data parallelism and ZeRO 1/2/3, bf16, recomputation and checkpoints; pipeline and context parallelism are
refused by name (see spans.SpanCorruptionObjective.check and docs/architecture.md).

``TRAITS`` describe the stacks' blocks to the memory plan and FLOP counter, which model decoder-only blocks: for
t5 they are estimates (two stacks and cross-attention are not counted separately).
"""

from __future__ import annotations

from megaloom.config import ConfigError, ModelConfig
from megaloom.model_keys.shape import resolved_kv_heads
from megaloom.models.family import Family, Traits
from megaloom.models.plan_styles import (
    Colwise,
    LocalHeads,
    Region,
    Rowwise,
    SequenceDropout,
    SequenceParallel,
    VocabEmbedding,
    VocabHead,
    VocabLoss,
)
from megaloom.models.t5.hf import HF
from megaloom.models.t5.model import T5Model
from megaloom.models.t5.presets import PRESETS
from megaloom.models.t5.spans import SpanCorruptionObjective

TRAITS = Traits(norm="rmsnorm", gated_mlp=True, bias=False, positions="relative", default_ffn_dim=lambda d: 4 * d,
                causal=False, encoder_decoder=True)


def validate(m: ModelConfig) -> None:
    kv = resolved_kv_heads(m)
    for key, value, ok, why in (
            ("model.n_kv_heads", kv, m.n_heads, f"T5 has multi-head attention: set it to 0 or {m.n_heads}"),
            ("model.parallel_block", m.parallel_block, False, "T5's blocks are sequential: set it to false"),
            ("model.sliding_window", m.sliding_window, 0, "T5 attends to the whole sequence: set it to 0"),
            ("model.moe_every", m.moe_every, 0, "no MoE T5 is built: set it to 0")):
        if value != ok:
            raise ConfigError(f"{key}={value} with model.arch=t5: {why}.")
    if m.head_dim and m.head_dim * m.n_heads != m.d_model:  # T5Attention's heads are d_model / n_heads wide
        raise ConfigError(f"model.head_dim={m.head_dim} with model.arch=t5: T5's attention here has heads of "
                          f"d_model / n_heads = {m.d_model / m.n_heads:g}; set it to 0.")


def _attention(prefix: str) -> dict:
    return {prefix: (Region(), LocalHeads()), f"{prefix}.q_proj": Colwise(), f"{prefix}.k_proj": Colwise(),
            f"{prefix}.v_proj": Colwise(), f"{prefix}.o_proj": Rowwise(), f"{prefix}.resid_dropout": SequenceDropout()}


# Megatron's layout for both stacks: heads and MLP units split over tp, the vocabulary-split shared embedding,
# head and loss, the norms on the (with sp: sequence-sharded) residual streams; plus the bias tables split by
# heads (column-parallel: weight [heads, buckets]) and the encoder's output entering the decoder's regions once.
PLAN = {"tok_emb": VocabEmbedding(), "drop": SequenceDropout(), "enc_bias": Colwise(), "dec_bias": Colwise(),
        "enc_out": Region(), "layers.*.attn_norm": SequenceParallel(), "layers.*.cross_norm": SequenceParallel(),
        "layers.*.mlp_norm": SequenceParallel(), **_attention("layers.*.attn"), **_attention("layers.*.cross"),
        "layers.*.mlp": Region(), "layers.*.mlp.gate_proj": Colwise(), "layers.*.mlp.up_proj": Colwise(),
        "layers.*.mlp.down_proj": Rowwise(), "layers.*.mlp.dropout": SequenceDropout(),
        "enc_norm": SequenceParallel(), "norm": SequenceParallel(), "head": VocabHead(), "loss": VocabLoss()}


class _T5Family(Family):
    def build(self, cfg: ModelConfig) -> T5Model:
        return T5Model(cfg, self)


FAMILY = _T5Family(name="t5", description="encoder-decoder, relative position buckets, span corruption (T5 v1.1)",
                   traits=TRAITS, plan=PLAN, presets=PRESETS, hf=HF, validate=validate,
                   objective=SpanCorruptionObjective)
