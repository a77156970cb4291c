"""A family's traits, and what the shared decoder reads of a family: the two things both megaloom/models/family.py
and megaloom/models/transformer.py need, below both (family.py builds on the decoder; the decoder reads its family
through `FamilyView` without importing family.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from torch import nn

    from megaloom.models.plan_styles import Plan


@dataclass(frozen=True)
class Traits:
    """How a family's decoder differs from the others (read by the shared decoder, megaloom/models/transformer.py,
    and by the memory plan and FLOP counter instead of the family's name).

    ``norm``: "layernorm" (with bias) or "rmsnorm". ``gated_mlp``: SwiGLU (gate, up, down) rather than GeLU
    (up, down). ``bias``: biases in every linear layer. ``positions``: "learned" (an embedding table) or "rope".
    ``default_ffn_dim``: the MLP width from d_model when model.ffn_dim is 0. ``attention``: the attention module
    class (constructor as `megaloom.models.attention.Attention`). ``qk_norm``: RMSNorm over each query/key head
    before RoPE (Qwen3, OLMo-2): parameters ``attn.q_norm`` / ``attn.k_norm``.

    Encoders (BERT) differ by the rest, all off for decoders: ``causal`` False: every token attends to the whole
    sequence. ``post_norm``: each residual add is followed by its norm (``x = norm(x + f(x))``) instead of
    pre-norm. ``gelu``: the GeLU MLP's approximation, "tanh" (GPT-2's gelu_new) or "none" (the exact erf GeLU,
    HF's "gelu"). ``token_types``: rows of a segment embedding ``type_emb`` added to the input (segment 0 for
    every token of a packed row). ``embed_norm``: a norm ``emb_norm`` after the summed embeddings.
    ``head_transform``: the final-norm slot ``norm`` holds the masked-LM transform (dense, GeLU, norm: its
    ``dense`` and ``norm``) instead of a bare norm. ``head_bias``: a bias on the vocabulary projection.
    ``sentence_order``: the family may carry ALBERT's sentence-order head (model.sentence_order: a pooler over the
    first token and a 2-way head; its objective builds the sentence pairs); config validation refuses the key
    for the others. ``softcap``: the family builds attention and final-logit soft-capping (model.attn_softcap /
    final_softcap, Gemma 2's); config validation refuses them for the others. ``query_scale``: the family scales
    attention scores by model.query_pre_attn_scalar^-1/2 where it is set (Gemma 2 27B); refused for the others.

    What the rest of megaloom asks instead of probing a module or a config key (issue 50): ``images``: the family
    may carry an image encoder, built when model.vision_layers > 0 (llava; `Family.reads_images`); config
    validation refuses vision_layers for the others. ``encoder_decoder``: the module encodes the prompt and
    decodes from a start token (t5: ``start_decoding``, ``decode_step``, ``seq2seq``), which generation takes."""

    norm: str
    gated_mlp: bool
    bias: bool
    positions: str
    default_ffn_dim: Callable[[int], int]
    attention: type | None = None  # None: megaloom.models.attention.Attention
    qk_norm: bool = False
    causal: bool = True
    post_norm: bool = False
    gelu: str = "tanh"
    token_types: int = 0
    embed_norm: bool = False
    head_transform: bool = False
    head_bias: bool = False
    sentence_order: bool = False
    softcap: bool = False
    query_scale: bool = False
    images: bool = False
    encoder_decoder: bool = False


class FamilyView(Protocol):
    """What the shared decoder asks of its family (`megaloom.models.family.Family` is one)."""

    @property
    def traits(self) -> Traits: ...

    @property
    def plan(self) -> Plan: ...

    def build(self, cfg: Any) -> nn.Module: ...
