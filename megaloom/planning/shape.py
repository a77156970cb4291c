"""The model's shape with its "auto" sizes filled in: pure functions of the config and the tokenizer's vocabulary.

Below both users: the memory plan (`megaloom memory` plans the shape a run would resolve) and the trainer's
resolution (`training/resolve.py`, which also chooses the micro-batch from the memory plan). They lived in
resolve.py, so the planner imported the trainer's resolution, which imports the planner (issue 37).
"""

from __future__ import annotations

import copy
import dataclasses
import math

from megaloom.config import Config, ModelConfig
from megaloom.model_keys.shape import resolved_shape
from megaloom.preflight import preflight_vocab


def vocab_pad_multiple(cfg: Config) -> int:
    """model.vocab_size=0 pads the tokenizer's vocabulary to a multiple of 64 that tensor parallelism divides."""
    return math.lcm(64, cfg.parallel.tp)


def resolved_model(m: ModelConfig, tokenizer_vocab: int, pad_multiple: int = 64) -> ModelConfig:
    """A copy of `m` with the sizes left at 0 ("auto") filled in; refuses a vocabulary the tokenizer overflows."""
    preflight_vocab(m, tokenizer_vocab)
    vocab = m.vocab_size or pad_multiple * math.ceil(tokenizer_vocab / pad_multiple)
    return dataclasses.replace(resolved_shape(m), vocab_size=vocab)


def shaped(cfg: Config) -> Config:
    """A copy of ``cfg`` with the model's "auto" sizes filled in as `megaloom train` fills them, the vocabulary from
    the default tokenizer's (model.vocab_size = 0): the one shape every planning command (`megaloom plan`,
    `megaloom memory`, the memory fit, the dry run's plan) reads; the trainer resolves with its own tokenizer."""
    return dataclasses.replace(copy.deepcopy(cfg), model=resolved_model(cfg.model, cfg.data.default_vocab_size,
                                                                        vocab_pad_multiple(cfg)))


def resolve_model_shape(cfg: Config, tokenizer_vocab: int, pad_multiple: int = 64) -> None:
    """Fill in the model sizes left at 0 ("auto") of `cfg` in place (for planning copies, e.g. `megaloom
    memory`); training uses `resolve_config`, which leaves its argument alone."""
    resolved = resolved_model(cfg.model, tokenizer_vocab, pad_multiple)
    for f in dataclasses.fields(ModelConfig):
        setattr(cfg.model, f.name, getattr(resolved, f.name))
