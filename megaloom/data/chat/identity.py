"""What conversations a chat run trained on, recorded in each checkpoint as token files' identities are
(data/identity.py): per conversation source its size and a hash (whole up to 4 MiB, else sampled blocks; a
save_to_disk folder: its files' sizes summed and their hashes hashed together), and a hash of what turns text into
tokens (the tokenizer's SHA-256, the chat template's source, and for tables data.chat_column / chat_split). A resume
on other files, or with another tokenizer or template, would read other rows: refused unless
checkpoint.allow_data_change=true."""

from __future__ import annotations

from typing import TYPE_CHECKING

from megaloom.data.cache import short_hash
from megaloom.data.chat.records import chat_files, source_files
from megaloom.data.chat.templates import resolve_template
from megaloom.data.file_hash import INDEX_BLOCK, INDEX_BLOCKS, WHOLE_INDEX_BYTES, sampled_hash
from megaloom.data.provenance import tokenizer_sha256
from megaloom.data.tokenizer import Tokenizer

if TYPE_CHECKING:
    from megaloom.config import DataConfig

KIND = "chat"
COMPARED = ("bytes", "hash", "render")


def chat_identity(data: DataConfig, tok: Tokenizer) -> list[dict]:
    template = resolve_template(data.chat_template, data.tokenizer, tok.hf.get_vocab())
    tables = (data.chat_column, data.chat_split) if (data.chat_column, data.chat_split) != ("messages", "") else ()
    render = short_hash(tokenizer_sha256(tok.path), template.source, *tables)
    return [{"path": str(f.resolve()), "kind": KIND, **_size_and_hash(f), "render": render}
            for f in chat_files(data.paths)]


def _hash(f) -> str:
    return sampled_hash(f, INDEX_BLOCKS, INDEX_BLOCK, whole_below=WHOLE_INDEX_BYTES)


def _size_and_hash(source) -> dict:
    if not source.is_dir():
        return {"bytes": source.stat().st_size, "hash": _hash(source)}
    files = source_files(source)
    return {"bytes": sum(f.stat().st_size for f in files),
            "hash": short_hash(*[(str(f.relative_to(source)), _hash(f)) for f in files])}


def what_changed(then: dict, now: dict) -> str:
    if then.get("render") != now["render"] and then.get("bytes") == now["bytes"] and then.get("hash") == now["hash"]:
        return "the same file, rendered with another tokenizer or data.chat_template"
    return f"{then.get('bytes', '?'):,} bytes then, {now['bytes']:,} now" if then.get("bytes") != now["bytes"] else (
        "the same size, other content")
