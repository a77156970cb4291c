"""``megaloom preprocess``: text files / JSON-lines / Parquet / Hugging Face datasets on disk -> tokenized,
memory-mappable token files (Parquet and datasets inputs: `megaloom.data.tabular`)."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
from collections import deque
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
from tqdm import tqdm

from megaloom.data.errors import DataError
from megaloom.data.indexed import IndexStats, dtype_for_vocab, write_indexed
from megaloom.data.provenance import write_provenance
from megaloom.data.tabular import PARQUET_SUFFIXES, check_source, is_hf_dataset_dir, is_tabular, iter_rows
from megaloom.data.tokenizer import Tokenizer

JSON_SUFFIXES = (".jsonl", ".json")
# What a folder contributes; an explicitly named file is read whatever its suffix. (A folder written by datasets'
# save_to_disk is one dataset, read whole; .arrow files only when named.)
FOLDER_SUFFIXES = (".txt", ".md", ".py", ".rst", ".jsonl", *PARQUET_SUFFIXES)
CHUNK_DOCS, CHUNK_CHARS = 1024, 1 << 20
INFLIGHT_PER_WORKER = 4


def _input_files(inputs: list[str]) -> Iterator[Path]:
    for raw in inputs:
        path = Path(raw).expanduser()
        if is_hf_dataset_dir(path):
            yield path
        elif path.is_dir():
            # Sorted so the token files (and hence every sample) are identical on every machine.
            yield from sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in FOLDER_SUFFIXES)
        elif path.is_file():
            yield path
        else:
            raise DataError(f"input {path} does not exist; pass existing files or folders")


def _read_jsonl(path: Path, json_key: str) -> Iterator[str]:
    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno} is not valid JSON ({e.msg}); .json/.jsonl inputs must hold "
                                "one JSON object per line") from e
            if not isinstance(record, dict) or json_key not in record:
                found = sorted(record)[:10] if isinstance(record, dict) else type(record).__name__
                raise DataError(f"{path}:{lineno} has no {json_key!r} field (found {found}); set --text-column "
                                "(json_key) to the field that holds the text")
            text = record[json_key]
            if not isinstance(text, str):
                raise DataError(f"{path}:{lineno} field {json_key!r} is {type(text).__name__}, expected "
                                "a string")
            yield text


def iter_documents(inputs: list[str], json_key: str = "text", split: str | None = None) -> Iterator[str]:
    """The non-empty documents of ``inputs`` (files or folders) in a deterministic order.

    JSON-lines files give one document per line, Parquet files and datasets on disk one per row (``json_key``: the
    field or column holding the text; ``split``: a DatasetDict's split, needed where it has several); any other
    file is one document.
    Undecodable bytes become U+FFFD rather than aborting a long run over one odd file. The inputs are listed, and
    the Parquet / datasets ones opened and their column checked, before the first document is returned.
    """
    files = list(_input_files(inputs))
    for path in files:
        if is_tabular(path):
            check_source(path, json_key, split)
    return _documents(files, json_key, split)


def _documents(files: list[Path], json_key: str, split: str | None) -> Iterator[str]:
    for path in files:
        if is_tabular(path):
            texts: Iterable[str] = iter_rows(path, json_key, split)
        elif path.suffix in JSON_SUFFIXES:
            texts = _read_jsonl(path, json_key)
        else:
            texts = [path.read_text(encoding="utf-8", errors="replace")]
        for text in texts:
            if text.strip():
                yield text


def _chunks(docs: Iterator[str]) -> Iterator[list[str]]:
    """Group documents so each worker task is big enough to amortise IPC but bounded in memory."""
    chunk: list[str] = []
    chars = 0
    for doc in docs:
        chunk.append(doc)
        chars += len(doc)
        if len(chunk) >= CHUNK_DOCS or chars >= CHUNK_CHARS:
            yield chunk
            chunk, chars = [], 0
    if chunk:
        yield chunk


_worker_tok: Tokenizer | None = None


def _init_worker(tokenizer_path: str) -> None:
    global _worker_tok
    _worker_tok = Tokenizer.from_file(tokenizer_path)


def _encode_chunk(docs: list[str]) -> list[np.ndarray]:
    assert _worker_tok is not None, "worker used before _init_worker"
    return _encode_with(_worker_tok, docs)


def _encode_with(tok: Tokenizer, docs: list[str]) -> list[np.ndarray]:
    """Token ids of each document followed by the EOD token, already in the on-disk dtype."""
    dtype, eod = dtype_for_vocab(tok.vocab_size), tok.eod_id
    out = []
    for ids in tok.encode_batch(docs):
        arr = np.empty(len(ids) + 1, dtype=dtype)
        arr[:-1] = ids
        arr[-1] = eod
        out.append(arr)
    return out


@contextmanager
def _no_tokenizer_threads_in_children() -> Iterator[None]:
    """Forked workers each run one tokenizer thread: N processes x N Rust threads would oversubscribe,
    and HF tokenizers warns when forked after using threads unless this variable is set."""
    key = "TOKENIZERS_PARALLELISM"
    old = os.environ.get(key)
    os.environ[key] = "false"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = old


def _encode_parallel(chunks: Iterator[list[str]], tokenizer_path: str,
                     workers: int) -> Iterator[list[np.ndarray]]:
    """Encode chunks in a process pool, in input order, with a bounded number in flight.

    ``Pool.imap`` would drain the whole input iterator into its task queue ahead of the workers;
    a window of pending ``apply_async`` results keeps memory flat on corpora larger than RAM.
    """
    ctx = mp.get_context("fork") if "fork" in mp.get_all_start_methods() else mp.get_context()
    with _no_tokenizer_threads_in_children():
        pool = ctx.Pool(workers, initializer=_init_worker, initargs=(tokenizer_path,))
    with pool:
        pending: deque = deque()
        for chunk in chunks:
            pending.append(pool.apply_async(_encode_chunk, (chunk,)))
            if len(pending) >= workers * INFLIGHT_PER_WORKER:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


def preprocess(inputs: list[str], tokenizer_path: str | Path, out_prefix: str | Path, workers: int = 2,
               json_key: str = "text", show_progress: bool = True, split: str | None = None) -> IndexStats:
    """Tokenize every document of ``inputs`` (EOD appended) into ``out_prefix.bin``/``.idx``, and record the
    tokenizer in ``out_prefix.tokenizer.json`` (data/provenance.py). ``json_key``: the JSONL field / Parquet or
    datasets column holding the text; ``split``: the split of a saved DatasetDict (needed where it has several)."""
    tokenizer_path = str(tokenizer_path)
    tok = Tokenizer.from_file(tokenizer_path)
    tok.eod_id  # noqa: B018 -- fail now, not inside a worker, if the tokenizer has no EOD token
    docs = iter_documents(inputs, json_key, split)
    first = next(docs, None)
    if first is None:
        raise DataError(f"no documents found in {inputs}: the inputs are empty or (for folders) contain no "
                        f"{', '.join(FOLDER_SUFFIXES)} files or saved datasets; pass files with text")

    def all_docs() -> Iterator[str]:
        yield first
        yield from docs

    if workers <= 1:
        encoded = (_encode_with(tok, chunk) for chunk in _chunks(all_docs()))
    else:
        encoded = _encode_parallel(_chunks(all_docs()), tokenizer_path, workers)

    bar = tqdm(desc="tokenizing", unit="doc", disable=not show_progress)

    def flat() -> Iterator[np.ndarray]:
        for arrays in encoded:
            yield from arrays
            bar.update(len(arrays))

    try:
        stats = write_indexed(out_prefix, flat(), tok.vocab_size)
        write_provenance(out_prefix, tokenizer_path, tok.vocab_size)  # training with another tokenizer stops
        return stats
    finally:
        encoded.close()  # shuts the worker pool down promptly if writing failed
        bar.close()
