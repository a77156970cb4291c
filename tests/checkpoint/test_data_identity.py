"""A data file replaced between runs (same path, other content) is not resumed from silently: each checkpoint
records the identity of its token files, a resume on other data is refused in one line naming the dataset, what
changed and the fix (checkpoint.allow_data_change=true), and checkpoints written before the record still resume."""

from __future__ import annotations

import json
import shutil

import numpy as np

from megaloom.checkpoint.store import MANIFEST, STATE, _sha256
from megaloom.cli import main
from megaloom.data.indexed import IndexedTokens, write_indexed
from tests.conftest import tiny_overrides


def _rewrite(prefix: str, change) -> None:
    """Replace prefix.bin/.idx in place with ``change(list of documents)`` (same tokenizer, other content)."""
    t = IndexedTokens(prefix)
    docs = [np.array(t.doc(i)) for i in range(t.n_docs)]
    vocab = t.vocab_size
    del t  # the memmaps: the files are replaced below
    write_indexed(prefix, change(docs), vocab)


def _drop_data_record(ckpt) -> None:
    """Make ``ckpt`` look written before the data record existed (state.json without it, manifest to match)."""
    state = json.loads((ckpt / STATE).read_text())
    del state["data"]
    (ckpt / STATE).write_text(json.dumps(state, indent=1))
    manifest = json.loads((ckpt / MANIFEST).read_text())
    manifest[STATE] = {"sha256": _sha256(ckpt / STATE), "bytes": (ckpt / STATE).stat().st_size}
    (ckpt / MANIFEST).write_text(json.dumps(manifest, indent=1))


def test_resume_on_replaced_data_is_refused_unless_allowed(small_corpus, tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    for ext in (".bin", ".idx", ".tokenizer.json"):
        shutil.copy(small_corpus["prefix"] + ext, data / f"mix{ext}")
    prefix, run = str(data / "mix"), tmp_path / "run"
    corpus = {**small_corpus, "prefix": prefix}

    def train(steps: int, *extra: str) -> int:
        return main(["train", *tiny_overrides(corpus, run, f"train.steps={steps}", "checkpoint.every=0", *extra)])

    assert train(2) == 0
    ckpt = run / "checkpoints" / "step_00000002"
    (record,) = json.loads((ckpt / STATE).read_text())["data"]
    t = IndexedTokens(prefix)
    assert record["path"] == prefix and (record["tokens"], record["docs"]) == (t.n_tokens, t.n_docs)
    del t
    capsys.readouterr()

    # Same sizes, same document boundaries, other token ids (each document reversed): only the .bin sample differs.
    _rewrite(prefix, lambda docs: [d[::-1] for d in docs])
    assert train(3) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"megaloom: error: checkpoint {ckpt} was trained on other data") and prefix in line, line
    assert "other token ids (its .bin differs)" in line and "checkpoint.allow_data_change=true" in line, line

    # One document fewer: the counts say what changed.
    _rewrite(prefix, lambda docs: docs[:-1])
    assert train(3) == 2
    (line,) = capsys.readouterr().err.splitlines()
    n_tokens = json.loads((ckpt / STATE).read_text())["data"][0]["tokens"]
    assert f"{n_tokens:,} tokens in {record['docs']:,} documents then" in line, line
    assert f"in {record['docs'] - 1:,} documents now" in line, line

    # Asked for: it continues on the new data, saying so; the new checkpoint records the new data.
    assert train(3, "checkpoint.allow_data_change=true") == 0
    out = capsys.readouterr()
    assert "continuing on the new data" in out.out + out.err
    new = json.loads((run / "checkpoints" / "step_00000003" / STATE).read_text())["data"][0]
    assert new["docs"] == record["docs"] - 1

    # A checkpoint from before the record (none in state.json) resumes on any data, as it always did.
    _drop_data_record(run / "checkpoints" / "step_00000003")
    _rewrite(prefix, lambda docs: docs[:-1])
    assert train(4) == 0
    assert "resumed from" in capsys.readouterr().out
