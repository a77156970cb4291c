"""What conversations a chat run trained on, recorded in each checkpoint as token files' identities are
(data/identity.py): per conversation file its size and a hash (whole up to 4 MiB, else sampled blocks), and a hash
of what turns text into tokens (the tokenizer's SHA-256 and the chat template's source). A resume on other files,
or with another tokenizer or template, would read other rows: refused unless checkpoint.allow_data_change=true."""

from __future__ import annotations

from typing import TYPE_CHECKING

from megaloom.data.cache import short_hash
from megaloom.data.chat.records import chat_files
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
    render = short_hash(tokenizer_sha256(tok.path), template.source)
    return [{"path": str(f.resolve()), "kind": KIND, "bytes": f.stat().st_size,
             "hash": sampled_hash(f, INDEX_BLOCKS, INDEX_BLOCK, whole_below=WHOLE_INDEX_BYTES), "render": render}
            for f in chat_files(data.paths)]


def what_changed(then: dict, now: dict) -> str:
    if then.get("render") != now["render"] and then.get("bytes") == now["bytes"] and then.get("hash") == now["hash"]:
        return "the same file, rendered with another tokenizer or data.chat_template"
    return f"{then.get('bytes', '?'):,} bytes then, {now['bytes']:,} now" if then.get("bytes") != now["bytes"] else (
        "the same size, other content")
