"""Tokenizers: loading any HF ``tokenizer.json`` and training the default byte-level BPE."""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers
from tqdm import tqdm

from megaloom.data.cache import tmp_name
from megaloom.data.errors import DataError
from megaloom.observe.log import TO_STDERR, get_logger

log = get_logger(__name__)

EOD_TOKEN = "<|endoftext|>"
IMAGE_TOKEN = "<image>"  # where an image's features go in a multimodal model's input
# Conventional end-of-document tokens of common tokenizer families, most specific first.
EOD_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")
# Every byte must be a token of its own for byte-level BPE to encode any text; plus the EOD token.
MIN_BPE_VOCAB = 257


class Tokenizer:
    """A thin wrapper over ``tokenizers.Tokenizer`` exposing what training needs: ids, vocab, EOD."""

    def __init__(self, hf: HFTokenizer, path: Path | None = None) -> None:
        self.hf = hf
        self.path = path
        # Documents are data: literal "<|endoftext|>" text inside a document must not become a real
        # document boundary, so special-token strings are tokenized as ordinary text.
        self.hf.encode_special_tokens = True
        self._eod_id = next((i for t in EOD_CANDIDATES if (i := hf.token_to_id(t)) is not None), None)

    @classmethod
    def from_file(cls, path: str | Path) -> Tokenizer:
        path = Path(path).expanduser()
        if not path.is_file():
            raise DataError(f"tokenizer file {path} does not exist; set data.tokenizer to a tokenizer.json "
                            "(or leave it empty to use the default tokenizer)")
        try:
            hf = HFTokenizer.from_file(str(path))
        except Exception as e:  # the Rust side raises a bare Exception for malformed files
            raise DataError(f"tokenizer file {path} could not be read as a HF tokenizer.json ({e}); "
                            "point data.tokenizer at a valid tokenizer.json or re-create it") from e
        return cls(hf, path)

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    @property
    def eod_id(self) -> int:
        if self._eod_id is None:
            raise DataError(f"tokenizer {self.path} has no end-of-document token (looked for "
                            f"{', '.join(EOD_CANDIDATES)}); add one of them as a special token")
        return self._eod_id

    @property
    def image_id(self) -> int | None:
        """The id of the ``<image>`` placeholder token (multimodal models), or None if the tokenizer has none."""
        return self.hf.token_to_id(IMAGE_TOKEN)

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self.hf.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"Tokenizer(path={str(self.path)!r}, vocab_size={self.vocab_size})"


def _bpe_trainer(vocab_size: int) -> tuple[HFTokenizer, trainers.BpeTrainer]:
    if vocab_size < MIN_BPE_VOCAB:
        raise DataError(f"tokenizer vocab_size {vocab_size} is too small for a byte-level BPE; it needs at "
                        f"least {MIN_BPE_VOCAB} (256 bytes + {EOD_TOKEN}), so raise data.default_vocab_size")
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    # The Rust progress bar prints blank lines when stderr is not a terminal (CI logs, pipes): callers that want
    # progress count documents with tqdm instead.
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    return hf, trainer


def _warn_if_short(hf: HFTokenizer, vocab_size: int) -> None:
    """BPE stops merging when no pair of tokens is left to merge (every word of the corpus is one token): a small
    corpus gives fewer tokens than asked, which used to pass without a word. One line on stderr says so."""
    reached = hf.get_vocab_size(with_added_tokens=True)
    if reached < vocab_size:
        log.warning(f"WARNING: the tokenizer has {reached:,} tokens, not the {vocab_size:,} asked: the corpus ran "
                    "out of pairs to merge (every word in it is already one token); train on more text for a "
                    f"larger vocabulary, or ask for {reached:,} or fewer", extra=TO_STDERR)


def _save_atomic(hf: HFTokenizer, out_path: Path) -> Path:
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp_name(out_path)
    try:
        hf.save(str(tmp))
        os.replace(tmp, out_path)
    finally:
        tmp.unlink(missing_ok=True)
    return out_path


def train_bpe(files: list[Path], vocab_size: int, out_path: Path, show_progress: bool = True) -> Path:
    """Train a byte-level BPE on ``files`` (each file's whole text) and write its tokenizer.json to ``out_path``
    atomically.

    Byte-level pre-tokenization plus the full 256-byte initial alphabet means every string encodes
    without unknown tokens and ``decode(encode(x)) == x`` exactly (no prefix space is added).
    """
    hf, trainer = _bpe_trainer(vocab_size)
    files = [Path(f) for f in files]
    if not files:
        raise DataError("no files to train the tokenizer on; pass at least one text file")
    for f in files:
        if not f.is_file():
            raise DataError(f"tokenizer training file {f} does not exist; check the corpus path")
    hf.train([str(f) for f in files], trainer)
    _warn_if_short(hf, vocab_size)
    return _save_atomic(hf, out_path)


def train_bpe_on_texts(texts: Iterable[str], vocab_size: int, out_path: Path, show_progress: bool = True) -> Path:
    """As `train_bpe`, on documents given as strings (e.g. `megaloom tokenizer train` over JSONL files, whose
    text field is what `megaloom preprocess` tokenizes, not the raw JSON lines)."""
    hf, trainer = _bpe_trainer(vocab_size)
    seen = 0

    def counted() -> Iterator[str]:
        nonlocal seen
        for text in tqdm(texts, desc="reading documents", unit="doc", disable=not show_progress):
            seen += 1
            yield text

    hf.train_from_iterator(counted(), trainer)
    if not seen:
        raise DataError("no documents to train the tokenizer on; the inputs hold no text")
    _warn_if_short(hf, vocab_size)
    return _save_atomic(hf, out_path)
