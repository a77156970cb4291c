"""Token ids >= the vocabulary inside a .bin with a valid header are refused when the data loads, naming the file
and the vocabulary, instead of an IndexError at step 1 (issue 19, fault 9); the scan is chunked and cached."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from megaloom.data import token_range
from megaloom.data.dataset import build_datasets
from megaloom.data.errors import DataError
from megaloom.data.indexed import IndexedTokens

VOCAB = 300  # tests/data/conftest.py: the fixture tokenizer's vocabulary


def _copy(prefix: str, dest: Path) -> str:
    dest.mkdir()
    for ext in (".bin", ".idx"):
        shutil.copy(prefix + ext, dest / ("corpus" + ext))
    return str(dest / "corpus")


def test_an_id_beyond_the_vocabulary_is_refused_at_load(tmp_path, tokens_prefix, make_cfg):
    prefix = _copy(tokens_prefix, tmp_path / "bad")
    t = IndexedTokens(prefix)
    pos = t.n_tokens - 3
    arr = np.memmap(prefix + ".bin", dtype=t.dtype, mode="r+")
    arr[pos] = VOCAB + 7
    arr.flush()
    del arr
    with pytest.raises(DataError) as err:
        build_datasets(make_cfg(paths=[prefix]), 16, 0, 100, 10)
    msg = str(err.value)
    assert prefix + ".bin" in msg and f"token id {VOCAB + 7}" in msg and f"first at token {pos}" in msg
    assert f"vocabulary of {VOCAB}" in msg and "model.vocab_size" in msg


def test_the_scan_is_chunked_and_cached(tmp_path, tokens_prefix, make_cfg, monkeypatch):
    prefix = _copy(tokens_prefix, tmp_path / "ok")
    t = IndexedTokens(prefix)
    assert token_range.largest_token_id(t, chunk=7) == int(np.asarray(t.tokens).max())
    build_datasets(make_cfg(paths=[prefix]), 16, 0, 100, 10)
    cached = list((Path(make_cfg().cache_dir) / "indices").glob("corpus-maxid-*.json"))
    assert len(cached) == 1

    def no_scan(*a, **k):
        raise AssertionError("scanned again")
    monkeypatch.setattr(token_range, "largest_token_id", no_scan)
    build_datasets(make_cfg(paths=[prefix]), 16, 0, 100, 10)  # the cached maximum is used
