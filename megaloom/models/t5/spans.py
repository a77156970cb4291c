"""T5's span-corruption objective (Raffel et al. 2020) on packed token rows: of a row's ``seq_len`` tokens 15%
are noise, in spans of mean length 3; each noise span is replaced in the encoder's input by one sentinel token,
and the decoder's target is every sentinel followed by the span it hides, then EOS.

The counts are functions of ``seq_len`` alone (noise = round(15% of L), spans = round(noise / 3)), as in T5's
``random_spans_noise_mask``, so every row has the same encoder length ``Te = L - noise + spans + 1`` and decoder
length ``Td = noise + spans + 1``: no padding. Where the spans lie is drawn from a generator seeded by
(train.seed, the split, the sample's global index): identical after a resume and in any data-parallel layout.

A sample is ``[2, Te + Td]``: row 0 the encoder input followed by the decoder input (the target shifted right
behind the decoder start token), row 1 -100 over the encoder part followed by the target.
`encoder_length(Te + Td)` recovers the split (the total grows strictly with L), so the model needs nothing else.

Sentinels are the tokenizer's ``<extra_id_k>`` when it has them, else ids past its vocabulary; the decoder start
is its ``<pad>`` (T5's), else a reserved id; EOS is its end-of-document token.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from megaloom.config import Config, ConfigError

SPLITS = {"train": 0, "valid": 1}
NOISE_DENSITY, MEAN_SPAN = 0.15, 3.0
MIN_SEQ = 8


def span_counts(length: int) -> tuple[int, int]:
    """(noise tokens, noise spans) of a row of ``length`` tokens."""
    noise = min(max(1, round(length * NOISE_DENSITY)), length - 1)
    return noise, max(1, round(noise / MEAN_SPAN))


def lengths(length: int) -> tuple[int, int]:
    """(encoder, decoder) lengths of a sample made from ``length`` tokens."""
    noise, spans = span_counts(length)
    return length - noise + spans + 1, noise + spans + 1


@lru_cache(maxsize=64)
def encoder_length(total: int) -> int:
    """The encoder part of a sample of ``total`` = Te + Td positions."""
    for length in range(total - 2, 0, -1):
        te, td = lengths(length)
        if te + td == total:
            return te
    raise ValueError(f"{total} positions are not a T5 span-corruption sample (encoder input + decoder input)")


def _parts(rng: np.random.Generator, n: int, k: int) -> np.ndarray:
    """``n`` items cut into ``k`` non-empty parts at random."""
    cuts = np.sort(rng.choice(np.arange(1, n), size=k - 1, replace=False))
    return np.diff(np.concatenate([[0], cuts, [n]]))


@dataclass(frozen=True)
class SpanCorruption:
    """The objective (`megaloom.data.objective.Objective`) for one tokenizer and seed."""

    vocab_size: int
    sentinels: np.ndarray  # sentinel k = sentinels[k]
    eos_id: int
    start_id: int  # the decoder's first input
    seed: int

    def sample(self, tokens: np.ndarray, index: int, split: str) -> np.ndarray:
        length = len(tokens) - 1
        row = tokens[:length].astype(np.int64)
        noise, spans = span_counts(length)
        rng = np.random.default_rng([self.seed, SPLITS[split], index])
        noise_lens, keep_lens = _parts(rng, noise, spans), _parts(rng, length - noise, spans)
        inputs, targets, pos = [], [], 0
        for k in range(spans):  # a kept stretch, then a noise span (T5's interleaving)
            inputs.append(row[pos:pos + keep_lens[k]])
            pos += keep_lens[k]
            inputs.append(self.sentinels[k:k + 1])
            targets += [self.sentinels[k:k + 1], row[pos:pos + noise_lens[k]]]
            pos += noise_lens[k]
        enc = np.concatenate([*inputs, [self.eos_id]])
        tgt = np.concatenate([*targets, [self.eos_id]])
        dec = np.concatenate([[self.start_id], tgt[:-1]])
        return np.stack([np.concatenate([enc, dec]), np.concatenate([np.full(len(enc), -100), tgt])])


class SpanCorruptionObjective:
    """What the t5 family registers as its ``objective``: refusals on the whole config, and the builder."""

    @staticmethod
    def check(cfg: Config) -> None:
        p, d, arch = cfg.parallel, cfg.data, cfg.model.arch
        if p.pp > 1:
            raise ConfigError(f"parallel.pp={p.pp} with model.arch={arch}: pipelines of an encoder-decoder (encoder "
                              "stages, then decoder stages each fed the encoder's output) are not built; set "
                              "parallel.pp=1 (docs/architecture.md says why).")
        if p.sp and p.tp > 1 and any(n % p.tp for n in lengths(cfg.train.seq_len)):
            fits = [n for n in range(max(MIN_SEQ, cfg.train.seq_len - 64), cfg.train.seq_len + 65)
                    if not any(k % p.tp for k in lengths(n))]
            near = min(fits, key=lambda n: abs(n - cfg.train.seq_len)) if fits else None
            raise ConfigError(f"train.seq_len={cfg.train.seq_len} with model.arch={arch} and parallel.sp=true: the "
                              f"encoder and decoder lengths {lengths(cfg.train.seq_len)} must both divide by "
                              f"parallel.tp={p.tp}" + (f"; train.seq_len={near} would work." if near else "."))
        if p.cp > 1:
            raise ConfigError(f"parallel.cp={p.cp} with model.arch={arch}: context parallelism is for causal "
                              "decoders; set parallel.cp=1.")
        for key, on in (("data.document_mask", d.document_mask), ("data.reset_positions", d.reset_positions)):
            if on:
                raise ConfigError(f"{key}=true with model.arch={arch}: a span-corruption sample is one encoder and "
                                  f"one decoder sequence; set {key}=false.")
        if cfg.train.seq_len < MIN_SEQ:
            raise ConfigError(f"train.seq_len={cfg.train.seq_len} with model.arch={arch}: span corruption needs at "
                              f"least {MIN_SEQ} tokens per row.")

    @staticmethod
    def build(cfg: Config, tokenizer) -> SpanCorruption:
        vocab, hf = tokenizer.vocab_size, getattr(tokenizer, "hf", None)
        n = span_counts(cfg.train.seq_len)[1]
        find = (lambda s: hf.token_to_id(s)) if hf is not None else (lambda s: None)  # noqa: E731
        if getattr(tokenizer, "path", None) == "":  # no vocabulary file (a dry run's synthetic tokens): its last ids
            return SpanCorruption(vocab_size=vocab, sentinels=np.arange(vocab - 1 - n, vocab - 1, dtype=np.int64)[::-1],
                                  eos_id=tokenizer.eod_id, start_id=vocab - 1, seed=cfg.train.seed)
        reserved = 0
        start = find("<pad>")
        if start is None:
            start, reserved = vocab, 1
        own = [find(f"<extra_id_{k}>") for k in range(n)]
        if all(i is not None for i in own):
            sentinels = np.array(own, dtype=np.int64)
        else:
            sentinels = np.arange(vocab + reserved, vocab + reserved + n, dtype=np.int64)
            reserved += n
        return SpanCorruption(vocab_size=vocab + reserved, sentinels=sentinels, eos_id=tokenizer.eod_id,
                              start_id=start, seed=cfg.train.seed)
