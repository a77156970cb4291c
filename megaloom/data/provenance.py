"""Which tokenizer made a token file, so that training with another one stops before any work.

`megaloom preprocess` writes `<prefix>.tokenizer.json` beside `<prefix>.bin`/`.idx`: the SHA-256 of the
tokenizer.json's bytes, its vocabulary size and the path it was read from (a hint for the error message). The
`.idx` header already holds the vocabulary size, but two tokenizers of one size (or a small vocabulary's tokens
fed to a larger tokenizer's embedding) would pass that check and train on garbage. Token files without the side
file (written by hand with `write_indexed`, or by an older megaloom) keep the header's check only.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from megaloom.data.cache import tmp_name
from megaloom.data.errors import DataError
from megaloom.data.indexed import resolve_prefix

SUFFIX = ".tokenizer.json"


def provenance_path(prefix: str | Path) -> Path:
    return Path(resolve_prefix(prefix) + SUFFIX)


def tokenizer_sha256(path: str | Path) -> str:
    return hashlib.sha256(Path(path).expanduser().read_bytes()).hexdigest()


def write_provenance(prefix: str | Path, tokenizer_path: str | Path, vocab_size: int) -> Path:
    """Record the tokenizer of `prefix`'s token files (atomically: a reader sees the old file or the new one)."""
    out = provenance_path(prefix)
    record = {"tokenizer_sha256": tokenizer_sha256(tokenizer_path), "vocab_size": int(vocab_size),
              "tokenizer_path": str(Path(tokenizer_path).expanduser().resolve())}
    tmp = tmp_name(out)
    try:
        tmp.write_text(json.dumps(record, indent=1) + "\n")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def read_provenance(prefix: str | Path) -> dict | None:
    path = provenance_path(prefix)
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
        if not isinstance(record, dict) or not isinstance(record.get("tokenizer_sha256"), str):
            raise ValueError("no tokenizer_sha256")
        return record
    except (OSError, ValueError) as e:
        raise DataError(f"{path} (which tokenizer made these token files) is unreadable ({e}); re-run "
                        "`megaloom preprocess` for this data, or delete the file to skip the check") from e


def check_tokenizer(prefix: str | Path, tokenizer_path: str | Path, vocab_size: int, setting: str) -> None:
    """Refuse token files made by another tokenizer than `tokenizer_path` (named in the error as `setting`)."""
    record = read_provenance(prefix)
    if record is None:
        return
    if record["tokenizer_sha256"] == tokenizer_sha256(tokenizer_path):
        return
    made_with = record.get("tokenizer_path", "?")
    raise DataError(
        f"token files {resolve_prefix(prefix)} were made with the tokenizer {made_with} "
        f"(vocab {record.get('vocab_size', '?')}), but this run uses {setting} {tokenizer_path} (vocab "
        f"{vocab_size}), a different tokenizer: set data.tokenizer={made_with}, or re-run `megaloom preprocess` "
        "with this tokenizer")
