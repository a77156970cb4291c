"""BERT's masked-LM objective on packed token rows (Devlin et al. 2019): each row becomes
``[CLS] tokens [SEP]`` of ``seq_len`` tokens; 15% of its ordinary tokens are chosen (a count per row, as
Megatron picks them, rounded up or down at random so that the expected share is 15%; at least one), and of
those 80% become ``[MASK]``, 10% a random ordinary token and 10% stay; labels hold the original token at the
chosen positions and -100 everywhere else (ignored by the loss). Special tokens ([CLS], [SEP], [MASK], the
end-of-document token, the tokenizer's other special tokens) are never chosen.

Every draw comes from a generator seeded by (train.seed, the split, the sample's global index): the masks of a
sample do not depend on which rank reads it, in which step, or whether the run was resumed.

[CLS], [SEP] and [MASK] are the tokenizer's own when it has them (spelled ``[CLS]``/``<cls>`` ...); otherwise
(megaloom's byte-level BPE has only ``<|endoftext|>``) they get the ids just past the tokenizer's vocabulary,
which model.vocab_size=0 then includes.

With model.sentence_order (ALBERT's sentence-order prediction, Lan et al. 2019) the row's body is cut into two
halves of consecutive text, A and B, and becomes ``[CLS] A [SEP] B [SEP]``, or ``[CLS] B [SEP] A [SEP]`` with
probability 0.5 (the first draw of the sample's generator); the sample is then ``[4, seq_len]``: inputs, labels,
segment ids (0 for ``[CLS] A [SEP]``, 1 for ``B [SEP]``) and the order label (1: swapped) repeated along the row.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megaloom.config import Config, ConfigError

SPLITS = {"train": 0, "valid": 1}  # the generator's stream per split: valid sample i is not train sample i
SPELLINGS = {"mask": ("[MASK]", "<mask>"), "cls": ("[CLS]", "<cls>"), "sep": ("[SEP]", "<sep>")}


@dataclass(frozen=True)
class MaskedLM:
    """The objective (`megaloom.data.objective.Objective`) for one tokenizer and seed."""

    vocab_size: int
    mask_id: int
    cls_id: int
    sep_id: int
    special: np.ndarray  # ids never chosen
    ordinary: np.ndarray  # ids a random replacement draws from
    seed: int
    mask_prob: float = 0.15
    replace_mask: float = 0.8  # of the chosen: [MASK]
    replace_random: float = 0.1  # of the chosen: a random ordinary token (the rest stay unchanged)
    sentence_order: bool = False  # model.sentence_order: rows [CLS] A [SEP] B [SEP], halves swapped at random

    def sample(self, tokens: np.ndarray, index: int, split: str) -> np.ndarray:
        t = len(tokens) - 1  # seq_len: a row holds seq_len + 1 tokens for the causal shift, unused here
        rng = np.random.default_rng([self.seed, SPLITS[split], index])
        if not self.sentence_order:
            inputs = np.concatenate([[self.cls_id], tokens[:t - 2], [self.sep_id]]).astype(np.int64)
            labels = self._mask(inputs, rng)  # replaces the chosen inputs in place
            return np.stack([inputs, labels])
        # The sentence-order draw comes first from the same generator: deterministic per (seed, split, index).
        swapped = bool(rng.random() < 0.5)
        body = tokens[:t - 3]
        first, second = body[:len(body) // 2], body[len(body) // 2:]
        if swapped:
            first, second = second, first
        inputs = np.concatenate([[self.cls_id], first, [self.sep_id], second, [self.sep_id]]).astype(np.int64)
        segments = np.zeros(t, dtype=np.int64)
        segments[len(first) + 2:] = 1  # [CLS] A [SEP] is segment 0, B [SEP] segment 1
        labels = self._mask(inputs, rng)
        # One int64 array per sample, so the loader, data-parallel slicing and micro-batching need no change;
        # the order label is repeated along the row (the model reads position 0).
        return np.stack([inputs, labels, segments, np.full(t, int(swapped), dtype=np.int64)])

    def _mask(self, inputs: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """Choose and replace (in place in ``inputs``) 15% of its ordinary tokens; returns the labels."""
        labels = np.full(len(inputs), -100, dtype=np.int64)
        candidates = np.flatnonzero(~np.isin(inputs, self.special))
        # 15% of the candidates, rounded up or down at random so that the expected share is exactly mask_prob
        # (always rounding would bias it: 18 of 123 is 14.6%); at least one, so that every row has a label.
        want = self.mask_prob * len(candidates)
        n = min(len(candidates), max(1, int(want) + int(rng.random() < want - int(want))))
        chosen = np.sort(rng.choice(candidates, size=n, replace=False))
        labels[chosen] = inputs[chosen]
        u = rng.random(n)
        inputs[chosen[u < self.replace_mask]] = self.mask_id
        rand = chosen[(u >= self.replace_mask) & (u < self.replace_mask + self.replace_random)]
        inputs[rand] = self.ordinary[rng.integers(len(self.ordinary), size=len(rand))]
        return labels


def _special_ids(tokenizer) -> set[int]:
    hf = getattr(tokenizer, "hf", None)
    ids = {i for i, tok in hf.get_added_tokens_decoder().items() if tok.special} if hf is not None else set()
    eod = getattr(tokenizer, "_eod_id", None) if hf is not None else getattr(tokenizer, "eod_id", None)
    return ids | ({eod} if eod is not None else set())


def _find(tokenizer, role: str) -> int | None:
    hf = getattr(tokenizer, "hf", None)
    if hf is None:
        return None
    return next((i for s in SPELLINGS[role] if (i := hf.token_to_id(s)) is not None), None)


class MaskedLMObjective:
    """What the bert family registers as its ``objective``: refusals on the whole config, and the builder."""

    @staticmethod
    def check(cfg: Config) -> None:
        d, p = cfg.data, cfg.parallel
        for key, on in (("data.document_mask", d.document_mask), ("data.reset_positions", d.reset_positions)):
            if on:
                raise ConfigError(f"{key}=true with model.arch={cfg.model.arch}: the masked-LM objective reads each "
                                  f"packed row as one [CLS] ... [SEP] sequence; set {key}=false.")
        if p.cp > 1:
            raise ConfigError(f"parallel.cp={p.cp} with model.arch={cfg.model.arch}: context parallelism splits "
                              "causal attention; bidirectional attention over split sequences is not built; set "
                              "parallel.cp=1.")
        if cfg.train.fused_loss is True:  # "auto" turns it off for a head with a bias (planning/levers.py)
            raise ConfigError(f"train.fused_loss=true with model.arch={cfg.model.arch}: the masked-LM head has a "
                              "bias, which the fused head + loss does not support; set train.fused_loss=false.")
        if cfg.train.seq_len < 3:
            raise ConfigError(f"train.seq_len={cfg.train.seq_len}: a masked-LM row is [CLS] tokens [SEP]; use at "
                              "least 3.")
        if cfg.model.sentence_order:
            if p.pp > 1:
                raise ConfigError(f"model.sentence_order=true with parallel.pp={p.pp}: the pipeline stages do not "
                                  "carry the segment ids and order labels in this build; set parallel.pp=1 (tp, sp "
                                  "and dp/ZeRO support it) or model.sentence_order=false.")
            if cfg.train.seq_len < 5:
                raise ConfigError(f"train.seq_len={cfg.train.seq_len}: a sentence-order row is [CLS] A [SEP] B [SEP]; "
                                  "use at least 5.")

    @staticmethod
    def build(cfg: Config, tokenizer) -> MaskedLM:
        vocab = tokenizer.vocab_size
        ids, reserved = {}, 0
        if getattr(tokenizer, "path", None) == "":  # no vocabulary file (a dry run's synthetic tokens): its last ids
            ids = {"mask": vocab - 1, "cls": vocab - 2, "sep": vocab - 3}
        for role in ("mask", "cls", "sep"):
            found = ids.get(role, _find(tokenizer, role))
            if found is None:
                found, reserved = vocab + reserved, reserved + 1
            ids[role] = found
        special = np.array(sorted(_special_ids(tokenizer) | set(ids.values())), dtype=np.int64)
        ordinary = np.setdiff1d(np.arange(vocab, dtype=np.int64), special)
        return MaskedLM(vocab_size=vocab + reserved, mask_id=ids["mask"], cls_id=ids["cls"], sep_id=ids["sep"],
                        special=special, ordinary=ordinary, seed=cfg.train.seed,
                        sentence_order=cfg.model.sentence_order)
