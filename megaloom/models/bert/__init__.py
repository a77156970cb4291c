"""BERT (Devlin et al. 2019, Megatron-LM's BertModel): a bidirectional encoder trained with the masked-LM
objective. The shared transformer with the encoder traits: bidirectional attention, post-norm blocks
(``x = LayerNorm(x + f(x))``), exact-erf GeLU MLP, biases, learned positions plus a segment (token-type)
embedding and a LayerNorm over the summed embeddings, and the masked-LM head (dense, GeLU, LayerNorm in the
final-norm slot ``norm``, then the vocabulary projection tied to the embedding, with a bias).

The parallel plan is the decoder's (Megatron splits BERT exactly as GPT) plus the encoder's replicated modules
on the residual stream: the segment embedding, the embedding norm and the head transform see only this rank's
tokens under sp, so their gradients are partial sums over tp (`SequencePositions`, `SequenceParallel`).

The objective (`masking.py`) turns each packed token row into ``[CLS] ... [SEP]`` inputs with 15% of the
tokens chosen (80% [MASK], 10% random, 10% kept) and labels -100 elsewhere, as a pure function of (seed, sample
index). The next-sentence / sentence-order head is not built (packed rows carry no sentence pairs).
"""

from __future__ import annotations

from megaloom.config import ConfigError, ModelConfig
from megaloom.model_keys.shape import resolved_kv_heads
from megaloom.models.bert.hf import HF, TYPE_VOCAB
from megaloom.models.bert.masking import MaskedLMObjective
from megaloom.models.bert.presets import PRESETS
from megaloom.models.family import Family, Traits
from megaloom.models.plan import DECODER_PLAN
from megaloom.models.plan_styles import SequenceFirst, SequenceParallel, SequencePositions

TRAITS = Traits(norm="layernorm", gated_mlp=False, bias=True, positions="learned", default_ffn_dim=lambda d: 4 * d,
                causal=False, post_norm=True, gelu="none", token_types=TYPE_VOCAB, embed_norm=True,
                head_transform=True, head_bias=True, sentence_order=True)

# The segment embedding looks up ids of the whole sequence and keeps this rank's shard under sp (as positions);
# the sentence-order pooler and head are replicated (each tp rank computes the same loss, identical gradients).
PLAN = {**DECODER_PLAN, "type_emb": SequencePositions(), "emb_norm": SequenceParallel(), "pooler": SequenceFirst()}


def validate(m: ModelConfig) -> None:
    """What the encoder does not have: grouped-query attention, the parallel block, windows, experts."""
    kv = resolved_kv_heads(m)
    for key, value, ok, why in (
            ("model.n_kv_heads", kv, m.n_heads, f"BERT has multi-head attention: set it to 0 or {m.n_heads}"),
            ("model.parallel_block", m.parallel_block, False, "BERT's blocks are post-norm: set it to false"),
            ("model.sliding_window", m.sliding_window, 0, "BERT attends to the whole sequence: set it to 0"),
            ("model.moe_every", m.moe_every, 0, "no MoE BERT is built: set it to 0")):
        if value != ok:
            raise ConfigError(f"{key}={value} with model.arch=bert: {why}.")


FAMILY = Family(name="bert", description="bidirectional encoder, post-norm, masked-LM objective (BERT)",
                traits=TRAITS, plan=PLAN, presets=PRESETS, hf=HF, validate=validate, objective=MaskedLMObjective)
