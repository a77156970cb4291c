"""Conversation files: JSONL, one conversation a line, ``{"messages": [{"role": ..., "content": ...}, ...]}``; or,
as chat datasets come from the Hugging Face Hub, Parquet files, datasets ``*.arrow`` files and ``save_to_disk``
folders (a Dataset, or a DatasetDict with its split named by ``data.chat_split``), one conversation a row, its
messages in the column ``data.chat_column`` (default ``messages``: a list of {role, content} structs). A row's
message keys that Arrow filled with null (a struct field other rows have, such as tool_calls) are left out, as a
JSONL line without them would be. Those sources are read with pyarrow / datasets (data/tabular.py), imported only
when such a source is given.

Every line is checked before anything is rendered or tokenized, and a bad one is one DataError naming the file,
the line, what is wrong and the fix (`data.paths` with `data.format=chat`). A message needs a string ``role`` and a
string ``content``; other keys are kept and passed to the template (a tokenizer's template may read them). A
conversation must have at least one ``assistant`` message: only those tokens are trained, so a conversation
without one would add nothing but padding (and a ShareGPT-style file, ``{"conversations": [{"from": "human",
"value": ...}]}``, would otherwise pass unnoticed).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from megaloom.data import tabular
from megaloom.data.errors import DataError

TRAINED_ROLE = "assistant"
SUFFIXES = (".jsonl", ".json")
TABULAR_SUFFIXES = tabular.PARQUET_SUFFIXES + tabular.ARROW_SUFFIXES
SHAPE = '{"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]}'


@dataclass(frozen=True)
class Conversation:
    messages: list[dict]
    where: str  # "file:line", for error messages


def chat_files(paths: list[str]) -> list[Path]:
    """The conversation sources of `data.paths`: files as given, ``save_to_disk`` folders as one source each, other
    folders' *.jsonl / *.json / *.parquet / *.arrow files and the save_to_disk folders inside them (sorted, so every
    machine reads the conversations in one order)."""
    files: list[Path] = []
    for raw in paths:
        path = Path(raw).expanduser()
        if tabular.is_hf_dataset_dir(path):
            files.append(path)
        elif path.is_dir():
            saved = _saved_datasets(path)
            found = sorted([p for p in path.rglob("*") if p.is_file() and p.suffix in SUFFIXES + TABULAR_SUFFIXES
                            and not any(d in p.parents for d in saved)] + saved)
            if not found:
                raise DataError(f"data.paths: folder {path} holds no conversation files (.jsonl, .parquet, .arrow "
                                "or a datasets save_to_disk folder; data.format=chat)")
            files.extend(found)
        elif path.is_file():
            files.append(path)
        else:
            raise DataError(f"data.paths: {path} does not exist; with data.format=chat, data.paths lists JSONL "
                            f"conversation files (or folders of them), one conversation a line: {SHAPE}")
    return files


def _saved_datasets(folder: Path) -> list[Path]:
    """The outermost save_to_disk folders under ``folder`` (a DatasetDict's split folders belong to it)."""
    dirs = sorted({p.parent for name in ("state.json", "dataset_dict.json") for p in folder.rglob(name)
                   if tabular.is_hf_dataset_dir(p.parent)})
    return [d for d in dirs if not any(o in d.parents for o in dirs)]


def source_files(source: Path) -> list[Path]:
    """The files a conversation source is read from (a save_to_disk folder's data and metadata), for the cache key
    and the checkpoint's record of the data."""
    if source.is_dir():
        return sorted(p for p in source.rglob("*") if p.is_file())
    return [source]


def _refuse(where: str, what: str, row: bool = False) -> DataError:
    if row:
        return DataError(f"{where}: {what}; with data.format=chat each row of a data.paths table must hold one "
                         "conversation in data.chat_column, a list of {role, content} messages: fix or remove the "
                         "row")
    return DataError(f"{where}: {what}; with data.format=chat each line of a data.paths file must be one "
                     f"conversation, {SHAPE}: fix or remove the line")


def parse_line(line: str, where: str) -> Conversation:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise _refuse(where, f"not valid JSON ({e.msg} at column {e.colno})") from None
    return check_record(record, where)


def check_record(record, where: str, row: bool = False) -> Conversation:
    """``record`` ({"messages": [...]}) checked as a conversation (``row``: a table's row, for the message)."""
    def refuse(what: str) -> DataError:
        return _refuse(where, what, row)

    if not isinstance(record, dict) or not isinstance(record.get("messages"), list):
        found = f"keys {sorted(record)[:6]}" if isinstance(record, dict) else f"a JSON {type(record).__name__}"
        hint = " (ShareGPT's conversations/from/value: rename them to messages/role/content)" if (
            isinstance(record, dict) and "conversations" in record) else ""
        raise refuse(f"no \"messages\" list (found {found}){hint}")
    messages = record["messages"]
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise refuse(f"message {i} is a JSON {type(m).__name__}, not an object with role and content")
        for key in ("role", "content"):
            if not isinstance(m.get(key), str):
                got = "missing" if key not in m else f"a JSON {type(m[key]).__name__}"
                raise refuse(f"message {i} has no string \"{key}\" ({got})")
    if not any(m["role"] == TRAINED_ROLE for m in messages):
        roles = sorted({m["role"] for m in messages}) or "none: the list is empty"
        raise refuse(f"no \"{TRAINED_ROLE}\" message to train on (roles found: {roles})")
    return Conversation(messages, where)


def read_conversations(path: Path, column: str = "messages", split: str = "") -> Iterator[Conversation]:
    """The conversations of one source, in order: a JSONL file's lines (blank ones skipped), or a table's rows
    (``column``: data.chat_column; ``split``: data.chat_split, for a DatasetDict)."""
    if path.suffix in TABULAR_SUFFIXES or tabular.is_hf_dataset_dir(path):
        yield from _table_conversations(path, column, split)
        return
    try:
        f = open(path, encoding="utf-8")
    except OSError as e:
        raise DataError(f"data.paths: cannot read {path} ({e})") from e
    with f:
        try:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    yield parse_line(line, f"{path}:{lineno}")
        except UnicodeDecodeError as e:
            raise DataError(f"{path}: not UTF-8 text ({e}); conversation files must be UTF-8 JSONL") from e


def _split(path: Path, split: str) -> str | None:
    """The split of a saved DatasetDict to read: data.chat_split, or its only split; a refusal names the splits."""
    splits = tabular.saved_splits(path) if path.is_dir() else None
    if splits is None:
        return None
    if not split and len(splits) == 1:
        return splits[0]
    if not split:
        raise DataError(f"{path} is a DatasetDict of {len(splits)} splits ({', '.join(sorted(splits))}): choose the "
                        f"one to train on with data.chat_split, e.g. data.chat_split={sorted(splits)[0]}")
    if split not in splits:
        raise DataError(f"{path} is a DatasetDict without a {split!r} split (it has {sorted(splits)}); set "
                        "data.chat_split to one of them")
    return split


def _table_rows(path: Path, column: str, split: str) -> Iterator:
    """The values of ``column``, row by row, read a batch at a time (Parquet: that column only)."""
    chosen = _split(path, split)
    if path.suffix in tabular.PARQUET_SUFFIXES:
        pq = tabular._need("pyarrow.parquet", path)
        try:
            f = pq.ParquetFile(str(path))
            names = list(f.schema_arrow.names)
        except Exception as e:  # pyarrow's own errors for a file that is not Parquet
            raise DataError(f"{path} is not a readable Parquet file ({type(e).__name__}: {e})") from None
        batches = (b.column(0).to_pylist() for b in f.iter_batches(batch_size=tabular.BATCH_ROWS, columns=[column])
                   ) if column in names else None
    else:
        data = tabular._open_hf(path, chosen)
        names = list(data.column_names)
        batches = ((b[column] for b in data.select_columns([column]).iter(batch_size=tabular.BATCH_ROWS))
                   if column in names else None)
    if batches is None:
        raise DataError(f"{path} has no column {column!r} (its columns: {', '.join(names[:10])}); set "
                        "data.chat_column to the column that holds each conversation's messages")
    for values in batches:
        yield from values


def _table_conversations(path: Path, column: str, split: str) -> Iterator[Conversation]:
    for row, messages in enumerate(_table_rows(path, column, split)):
        if not isinstance(messages, list):
            raise _refuse(f"{path} row {row}", f"column {column!r} holds {type(messages).__name__}, not a list of "
                                               "messages", row=True)
        if isinstance(messages, list):  # Arrow's null struct fields: keys this row's messages do not have
            messages = [{k: v for k, v in m.items() if v is not None or k in ("role", "content")}
                        if isinstance(m, dict) else m for m in messages]
        yield check_record({"messages": messages}, f"{path} row {row}", row=True)


def check_chat_files(paths: list[str], column: str = "messages", split: str = "") -> int:
    """Every conversation of every source parses (the launcher's and the builder's first pass, before any
    tokenizing); returns the number of conversations."""
    n = 0
    for path in chat_files(paths):
        for _ in read_conversations(path, column, split):
            n += 1
    if n == 0:
        raise DataError(f"data.paths ({', '.join(paths)}) hold no conversations (data.format=chat)")
    return n
