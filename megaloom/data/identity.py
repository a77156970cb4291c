"""What data a run trained on, recorded in each checkpoint so that a resume on other data is not silent.

Exact resume means step N+1 reads the samples the uninterrupted run would have read; that holds only for the same
token files. A file replaced at the same path (re-preprocessed, another corpus copied over it) used to be resumed
from silently. Each checkpoint's state.json therefore holds, per dataset, a cheap identity: the token and
document counts, the byte sizes of `.bin` and `.idx`, a hash of the `.idx` (whole up to 4 MiB; beyond, its size,
head, tail and evenly spaced blocks) and a hash of a few small blocks of the `.bin` (never the whole multi-GB
file). Reading it costs one header, at most a few MiB of the index and 64 KiB of tokens per dataset.

On resume the identities are compared by position in `data.paths` and by content, not by path (the same files
moved or copied elsewhere are the same data); a difference stops the resume with one line unless
`checkpoint.allow_data_change=true`. Checkpoints written before this record resume as before.
"""

from __future__ import annotations

import os
from pathlib import Path

from megaloom.data.file_hash import INDEX_BLOCK, INDEX_BLOCKS, WHOLE_INDEX_BYTES, sampled_hash
from megaloom.data.indexed import index_counts, resolve_prefix

TOKEN_BLOCKS, TOKEN_BLOCK = 16, 4 << 10  # the .bin: always sampled
# Fields compared on resume (the path is shown, not compared).
COMPARED = ("tokens", "docs", "bin_bytes", "idx_bytes", "idx_hash", "bin_sample_hash")


def dataset_identity(prefix: str | Path) -> dict:
    """The identity of one ``prefix.bin``/``prefix.idx`` pair (the files are validated when the data loads)."""
    prefix = resolve_prefix(prefix)
    bin_path, idx_path = Path(prefix + ".bin"), Path(prefix + ".idx")
    n_docs, n_tokens = index_counts(prefix)  # megaloom's or Megatron's .idx
    return {"path": os.path.abspath(prefix), "tokens": n_tokens, "docs": int(n_docs),
            "bin_bytes": bin_path.stat().st_size, "idx_bytes": idx_path.stat().st_size,
            "idx_hash": sampled_hash(idx_path, INDEX_BLOCKS, INDEX_BLOCK, whole_below=WHOLE_INDEX_BYTES),
            "bin_sample_hash": sampled_hash(bin_path, TOKEN_BLOCKS, TOKEN_BLOCK)}


def data_identity(prefixes: list[str]) -> list[dict]:
    return [dataset_identity(p) for p in prefixes]


def _count(n) -> str:
    return f"{n:,}" if isinstance(n, int) else "?"


def _what_changed(then: dict, now: dict) -> str:
    if (then.get("tokens"), then.get("docs")) != (now["tokens"], now["docs"]):
        return (f"{_count(then.get('tokens'))} tokens in {_count(then.get('docs'))} documents then, "
                f"{_count(now['tokens'])} tokens in {_count(now['docs'])} documents now")
    if then.get("idx_hash") != now["idx_hash"] or then.get("idx_bytes") != now["idx_bytes"]:
        return f"the same {now['tokens']:,} tokens in total, but other document boundaries (its .idx differs)"
    return f"the same {now['tokens']:,} tokens and documents, but other token ids (its .bin differs)"


def data_changes(saved: list[dict] | None, now: list[dict] | None) -> list[str]:
    """What differs between a checkpoint's data (``saved``) and this run's (``now``), one phrase per difference;
    empty when they match or either is unknown (a checkpoint from before the record, or data not from files)."""
    if not saved or not now:
        return []
    if len(saved) != len(now):
        return [f"{len(saved)} dataset(s) then ({', '.join(d.get('path', '?') for d in saved)}), {len(now)} now "
                f"({', '.join(d['path'] for d in now)})"]
    from megaloom.data.chat import identity as chat

    out = []
    for i, (then, cur) in enumerate(zip(saved, now, strict=True)):
        is_chat = cur.get("kind") == chat.KIND  # conversation files (data.format=chat): their own fields
        if then.get("kind") != cur.get("kind") or any(then.get(k) != cur[k]
                                                      for k in (chat.COMPARED if is_chat else COMPARED)):
            where = cur["path"] if then.get("path") == cur["path"] else f"{then.get('path')} then, {cur['path']} now"
            what = (chat.what_changed(then, cur) if is_chat and then.get("kind") == chat.KIND
                    else "another kind of data" if then.get("kind") != cur.get("kind") else _what_changed(then, cur))
            out.append(f"dataset {i + 1} ({where}): {what}")
    return out
