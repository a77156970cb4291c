"""The tokenizer of an image-text run and each record's tokens and loss mask.

data.tokenizer set: that tokenizer.json, which must have an ``<image>`` token. Empty: a byte-level BPE trained on
the records' own text (with the end-of-document and ``<image>`` special tokens), cached under data.cache_dir by a
hash of that text, so every rank and every later run finds the same file.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer as HFTokenizer

from megaloom.data.cache import short_hash, tmp_name
from megaloom.data.errors import DataError
from megaloom.data.tokenizer import IMAGE_TOKEN, Tokenizer, train_bpe_on_texts


def record_texts(records: list[dict]) -> list[str]:
    return [text.replace(IMAGE_TOKEN, " ") for r in records for _, text in r["turns"]]


def image_text_tokenizer(tokenizer_path: str, records: list[dict], cache: Path, vocab_size: int) -> Tokenizer:
    if tokenizer_path:
        tok = Tokenizer.from_file(tokenizer_path)
        if tok.image_id is None:
            raise DataError(f"data.tokenizer={tokenizer_path} has no '{IMAGE_TOKEN}' token: add it as a special "
                            "token, or leave data.tokenizer empty to train one on the image-text records")
        return tok
    texts = record_texts(records)
    path = cache / "image_text" / f"tokenizer-{short_hash(texts, vocab_size)}.json"
    if not path.is_file():
        tmp = tmp_name(path)
        train_bpe_on_texts(texts, vocab_size, tmp, show_progress=False)
        hf = HFTokenizer.from_file(str(tmp))
        hf.add_special_tokens([IMAGE_TOKEN])
        hf.save(str(tmp))
        os.replace(tmp, path)  # atomic: concurrent ranks write identical files
    return Tokenizer.from_file(path)


def encode_records(records: list[dict], tok: Tokenizer, tokens_per_image: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """(token ids int32, target mask bool) per record: each <image> becomes tokens_per_image image tokens (not
    targets), prompt text is not a target, answers and the closing end-of-document token are."""
    pieces, owners = [], []
    for r, rec in enumerate(records):
        for t, (_, text) in enumerate(rec["turns"]):
            for k, piece in enumerate(text.split(IMAGE_TOKEN)):
                pieces.append(piece)
                owners.append((r, t, k))
    ids = tok.encode_batch(pieces)
    image, eod = tok.image_id, tok.eod_id
    out: list[tuple[list[int], list[bool]]] = [([], []) for _ in records]
    for (r, t, k), piece_ids in zip(owners, ids, strict=True):
        toks, mask = out[r]
        if k > 0:  # an <image> came before this piece
            toks.extend([image] * tokens_per_image)
            mask.extend([False] * tokens_per_image)
        trained = records[r]["turns"][t][0] == "answer"
        toks.extend(piece_ids)
        mask.extend([trained] * len(piece_ids))
    for toks, mask in out:
        toks.append(eod)
        mask.append(True)
    return [(np.asarray(t, dtype=np.int32), np.asarray(m, dtype=bool)) for t, m in out]
