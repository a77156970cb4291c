"""Conversations -> token ids and target flags, cached on disk so that later runs and the other ranks only map them.

Each conversation is rendered into (text, trained) segments (segments.py), every segment tokenized on its own (the
prompt ends where the model starts answering, as at inference), and the end-of-document token appended: it closes
the conversation for document masks and restarting positions (models/documents.py). A token is a target when its
segment is trained; the end-of-document token is one when the conversation ends with an answer (the model learns
to stop there; `megaloom generate` stops at it), and a conversation's first token never is (it would be predicted
from the previous conversation). The rendered text is tokenized as transformers' `apply_chat_template` does:
special-token text (the template's ``<|im_start|>``, ``<|eot_id|>``) becomes the special token, and no
BOS/EOS is added by the tokenizer (templates write their own).

The cache (``<cache>/chat/<key>/``: ``tokens.npy`` int32, ``targets.npy`` bool, ``offsets.npy`` int64, one more
offset than conversations) is keyed by the files' paths, sizes and modification times, the tokenizer's SHA-256 and
the template's source: changing any of them renders again. Written under a temporary name and renamed (atomic).
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megaloom.data.cache import load_npy, short_hash, tmp_name
from megaloom.data.chat.records import Conversation, chat_files, read_conversations, source_files
from megaloom.data.chat.segments import segments
from megaloom.data.chat.templates import ChatTemplate
from megaloom.data.errors import DataError
from megaloom.data.provenance import tokenizer_sha256
from megaloom.data.tokenizer import Tokenizer
from megaloom.observe.log import get_logger

log = get_logger(__name__)
VERSION = 1  # bumped when what is cached (or how it is rendered) changes
BATCH = 1024  # conversations tokenized per encode_batch call


@dataclass(frozen=True)
class EncodedChats:
    """Every conversation's tokens back to back: conversation c is ``tokens[offsets[c]:offsets[c + 1]]``."""

    tokens: np.ndarray  # int32
    targets: np.ndarray  # bool: token j is trained (predicted at position j - 1)
    offsets: np.ndarray  # int64, n + 1

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)


@contextmanager
def _markup_as_specials(tok: Tokenizer) -> Iterator[None]:
    """megaloom encodes documents with special-token text as plain text (tokenizer.py); a rendered chat's markup
    must become the special tokens instead, as in transformers."""
    before = tok.hf.encode_special_tokens
    tok.hf.encode_special_tokens = False
    try:
        yield
    finally:
        tok.hf.encode_special_tokens = before


def encode_conversations(convs: list[Conversation], template: ChatTemplate, tok: Tokenizer,
                         eod_inside_ok: bool) -> EncodedChats:
    """Render and tokenize; ``eod_inside_ok=False`` (document masks or restarting positions on) refuses a
    conversation whose own tokens hold the end-of-document token, which would split it in two."""
    eod = tok.eod_id
    tokens: list[np.ndarray] = []
    targets: list[np.ndarray] = []
    with _markup_as_specials(tok):
        for start in range(0, len(convs), BATCH):
            part = convs[start:start + BATCH]
            pieces = [segments(template, c) for c in part]
            ids = tok.encode_batch([text for p in pieces for text, _ in p])
            at = 0
            for conv, p in zip(part, pieces, strict=True):
                if not p:
                    raise DataError(f"{conv.where}: the chat template {template.name} renders this conversation as "
                                    "no text; set data.chat_template to a template that writes the messages")
                conv_ids = ids[at:at + len(p)]
                at += len(p)
                toks = np.fromiter((i for piece in conv_ids for i in piece), dtype=np.int32)
                if not eod_inside_ok and (toks == eod).any():
                    raise DataError(f"{conv.where}: the rendered conversation holds the end-of-document token "
                                    f"{tok.hf.id_to_token(eod)!r} (from its text or the chat template), which "
                                    "data.document_mask / data.reset_positions read as the end of a conversation; "
                                    "remove it from the text, use another data.chat_template, or set "
                                    "data.document_mask=false data.reset_positions=false")
                flags = np.concatenate([np.full(len(i), trained) for i, (_, trained) in zip(conv_ids, p, strict=True)]
                                       + [np.array([p[-1][1]])])
                flags[0] = False
                tokens.append(np.append(toks, np.int32(eod)))
                targets.append(flags.astype(bool))
    offsets = np.zeros(len(tokens) + 1, dtype=np.int64)
    np.cumsum([len(t) for t in tokens], out=offsets[1:])
    return EncodedChats(np.concatenate(tokens).astype(np.int32), np.concatenate(targets), offsets)


def cache_key(paths: list[str], template: ChatTemplate, tok: Tokenizer, eod_inside_ok: bool,
              column: str = "messages", split: str = "") -> str:
    files = []
    for source in chat_files(paths):
        for f in source_files(source):
            st = f.stat()
            files.append((str(f.resolve()), st.st_size, st.st_mtime_ns))
    tables = (column, split) if (column, split) != ("messages", "") else ()  # JSONL-only keys stay as they were
    return short_hash(VERSION, files, tokenizer_sha256(tok.path), template.source, eod_inside_ok, *tables)


def _load(folder: Path) -> EncodedChats | None:
    arrays = [load_npy(folder / f"{name}.npy", mmap=True) for name in ("tokens", "targets", "offsets")]
    if any(a is None for a in arrays):
        return None
    return EncodedChats(*arrays)


def load_or_encode(paths: list[str], template: ChatTemplate, tok: Tokenizer, cache: Path,
                   eod_inside_ok: bool, column: str = "messages", split: str = "") -> EncodedChats:
    """The encoded conversations of ``paths`` from the cache, or rendered, tokenized and cached now (every line or
    row is checked before any is rendered; ``column`` / ``split``: data.chat_column / chat_split, for tables)."""
    folder = cache / "chat" / cache_key(paths, template, tok, eod_inside_ok, column, split)
    found = _load(folder)
    if found is not None:
        return found
    t0 = time.perf_counter()
    convs = [c for f in chat_files(paths) for c in read_conversations(f, column, split)]  # all parsed, then rendered
    if not convs:
        raise DataError(f"data.paths ({', '.join(paths)}) hold no conversations (data.format=chat)")
    enc = encode_conversations(convs, template, tok, eod_inside_ok)
    tmp = tmp_name(folder)
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        for name in ("tokens", "targets", "offsets"):
            np.save(tmp / f"{name}.npy", getattr(enc, name))
        try:
            os.replace(tmp, folder)
        except OSError:  # another process renamed an identical folder first
            if _load(folder) is None:
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info(f"data: {len(enc):,} conversations rendered with the {template.name} chat template, "
             f"{len(enc.tokens):,} tokens ({int(enc.targets.sum()):,} trained) in {time.perf_counter() - t0:.1f}s; "
             f"cached in {folder}")
    return _load(folder) or enc
