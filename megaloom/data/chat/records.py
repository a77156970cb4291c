"""Conversation files: JSONL, one conversation a line, ``{"messages": [{"role": ..., "content": ...}, ...]}``.

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

from megaloom.data.errors import DataError

TRAINED_ROLE = "assistant"
SUFFIXES = (".jsonl", ".json")
SHAPE = '{"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]}'


@dataclass(frozen=True)
class Conversation:
    messages: list[dict]
    where: str  # "file:line", for error messages


def chat_files(paths: list[str]) -> list[Path]:
    """The conversation files of `data.paths`: files as given, folders' *.jsonl / *.json files (sorted, so every
    machine reads the conversations in one order)."""
    files: list[Path] = []
    for raw in paths:
        path = Path(raw).expanduser()
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in SUFFIXES)
            if not found:
                raise DataError(f"data.paths: folder {path} holds no .jsonl conversation files (data.format=chat)")
            files.extend(found)
        elif path.is_file():
            files.append(path)
        else:
            raise DataError(f"data.paths: {path} does not exist; with data.format=chat, data.paths lists JSONL "
                            f"conversation files (or folders of them), one conversation a line: {SHAPE}")
    return files


def _refuse(where: str, what: str) -> DataError:
    return DataError(f"{where}: {what}; with data.format=chat each line of a data.paths file must be one "
                     f"conversation, {SHAPE}: fix or remove the line")


def parse_line(line: str, where: str) -> Conversation:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise _refuse(where, f"not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(record, dict) or not isinstance(record.get("messages"), list):
        found = f"keys {sorted(record)[:6]}" if isinstance(record, dict) else f"a JSON {type(record).__name__}"
        hint = " (ShareGPT's conversations/from/value: rename them to messages/role/content)" if (
            isinstance(record, dict) and "conversations" in record) else ""
        raise _refuse(where, f"no \"messages\" list (found {found}){hint}")
    messages = record["messages"]
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise _refuse(where, f"message {i} is a JSON {type(m).__name__}, not an object with role and content")
        for key in ("role", "content"):
            if not isinstance(m.get(key), str):
                got = "missing" if key not in m else f"a JSON {type(m[key]).__name__}"
                raise _refuse(where, f"message {i} has no string \"{key}\" ({got})")
    if not any(m["role"] == TRAINED_ROLE for m in messages):
        roles = sorted({m["role"] for m in messages}) or "none: the list is empty"
        raise _refuse(where, f"no \"{TRAINED_ROLE}\" message to train on (roles found: {roles})")
    return Conversation(messages, where)


def read_conversations(path: Path) -> Iterator[Conversation]:
    """The conversations of one file, in order; blank lines are skipped."""
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


def check_chat_files(paths: list[str]) -> int:
    """Every line of every conversation file parses (the launcher's and the builder's first pass, before any
    tokenizing); returns the number of conversations."""
    n = 0
    for path in chat_files(paths):
        for _ in read_conversations(path):
            n += 1
    if n == 0:
        raise DataError(f"data.paths ({', '.join(paths)}) hold no conversations (data.format=chat)")
    return n
