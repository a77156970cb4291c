from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from megaloom.config import DataConfig
from megaloom.data.blend import blend_plan
from megaloom.data.dataset import (
    BlendedDataset,
    PackedDataset,
    ShuffledDataset,
    build_datasets,
    shuffled_index,
)
from megaloom.data.errors import DataError
from megaloom.data.indexed import IndexedTokens
from megaloom.data.split import parse_split, split_ranges
from megaloom.data.tokenizer import Tokenizer, train_bpe

SEQ = 16


def _stream(ds: PackedDataset) -> np.ndarray:
    """Samples 0..n-1 joined, dropping the token each sample shares with the next."""
    return np.concatenate([ds[i][:-1] for i in range(len(ds))] + [ds[len(ds) - 1][-1:]])


def test_packed_samples_reproduce_the_split_stream(tokens_prefix: str, tokenizer_path: Path) -> None:
    t = IndexedTokens(tokens_prefix)
    eod = Tokenizer.from_file(tokenizer_path).eod_id
    ranges = split_ranges(t.n_docs, "75,25")
    for role, (first, last) in ranges.items():
        ds = PackedDataset(t, SEQ, (first, last), split=role)
        stream = np.asarray(t.tokens[t.doc_offsets[first]:t.doc_offsets[last]], dtype=np.int64)
        assert len(ds) == (len(stream) - 1) // SEQ
        got = _stream(ds)
        assert got.dtype == np.int64 and ds[0].shape == (SEQ + 1,)
        np.testing.assert_array_equal(got, stream[:len(got)])
        assert len(stream) - len(got) < SEQ  # only the ragged tail is unused
        assert int((stream == eod).sum()) == last - first  # one boundary per document


def test_split_ranges_disjoint_and_cover() -> None:
    for n_docs in (1, 2, 7, 100, 1001):
        for split in ("98,2", "50,50", "80,10,10", "1,0"):
            r = split_ranges(n_docs, split)
            assert r["train"][0] == 0 and r["train"][1] == r["valid"][0]
            if split.count(",") == 1:
                assert r["valid"][1] == n_docs
    assert split_ranges(100, "98,2") == {"train": (0, 98), "valid": (98, 100)}
    assert split_ranges(10, "80,10,10") == {"train": (0, 8), "valid": (8, 9)}
    assert parse_split(" 0.9 , 0.1 ") == pytest.approx((0.9, 0.1))


@pytest.mark.parametrize("bad", ["98", "a,b", "-1,2", "0,0", "1,2,3,4", ""])
def test_bad_split_rejected(bad: str) -> None:
    with pytest.raises(DataError, match=r"data.split"):
        parse_split(bad)


def test_too_short_split_names_setting(tokens_prefix: str) -> None:
    t = IndexedTokens(tokens_prefix)
    with pytest.raises(DataError, match=r"valid split.*train.seq_len"):
        PackedDataset(t, t.n_tokens, (t.n_docs - 1, t.n_docs), split="valid")


def test_shuffled_epochs_use_every_sample_once() -> None:
    idx = shuffled_index(37, 37 * 3 + 5, seed=1, cache_file=None)
    assert len(idx) == 116
    for e in range(3):
        assert sorted(idx[e * 37:(e + 1) * 37].tolist()) == list(range(37))
    assert not np.array_equal(idx[:37], idx[37:74]), "each epoch is reshuffled"
    assert len(set(idx[111:].tolist())) == 5


def test_shuffled_prefix_stable() -> None:
    np.testing.assert_array_equal(shuffled_index(300, 1000, 3)[:500], shuffled_index(300, 500, 3))
    assert not np.array_equal(shuffled_index(300, 500, 3), shuffled_index(300, 500, 4))


def test_shuffled_cache_reused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import megaloom.data.shuffle as shuffle

    cache = tmp_path / "idx" / "k.npy"
    first = shuffled_index(50, 120, 0, cache)
    assert cache.is_file()

    def boom(*_: object) -> np.ndarray:
        raise AssertionError("recomputed despite a valid cache file")

    monkeypatch.setattr(shuffle, "_epoch_permutation", boom)
    np.testing.assert_array_equal(shuffled_index(50, 120, 0, cache), first)
    np.testing.assert_array_equal(shuffled_index(50, 60, 0, cache), first[:60])


def test_shuffled_cache_ignores_bad_file(tmp_path: Path) -> None:
    cache = tmp_path / "k.npy"
    cache.write_bytes(b"garbage")
    np.testing.assert_array_equal(shuffled_index(20, 30, 0, cache), shuffled_index(20, 30, 0))
    np.save(cache, np.arange(30) + 100)  # out of range for 20 samples: stale, recompute
    np.testing.assert_array_equal(shuffled_index(20, 30, 0, cache), shuffled_index(20, 30, 0))


def test_shuffled_dataset_maps_through_index() -> None:
    base = [np.array([i]) for i in range(10)]
    ds = ShuffledDataset(base, 25, seed=5, cache_file=None)
    assert len(ds) == 25
    assert [int(ds[i][0]) for i in range(25)] == shuffled_index(10, 25, 5).tolist()


def test_blend_proportions_and_prefix_stability() -> None:
    weights = [0.5, 0.3, 0.2]
    ids, local = blend_plan(weights, 1000)
    counts = np.bincount(ids, minlength=3)
    assert np.all(np.abs(counts - np.array(weights) * 1000) <= 1)
    for d in range(3):  # local indices count up within each dataset
        assert local[ids == d].tolist() == list(range(counts[d]))
    ids2, local2 = blend_plan(weights, 400)
    np.testing.assert_array_equal(ids[:400], ids2)
    np.testing.assert_array_equal(local[:400], local2)
    # Every prefix stays within one sample of its share.
    onehot = np.eye(3)[ids].cumsum(0)
    assert np.abs(onehot - np.outer(np.arange(1, 1001), weights)).max() < 1
    # Ties go to the lowest dataset id.
    assert blend_plan([1, 1], 4)[0].tolist() == [0, 1, 0, 1]


def test_blended_dataset_requires_enough_samples() -> None:
    a, b = [np.array([0, i]) for i in range(10)], [np.array([1, i]) for i in range(2)]
    ds = BlendedDataset([a, b], [0.5, 0.5], 4)
    assert [ds[i].tolist() for i in range(4)] == [[0, 0], [1, 0], [0, 1], [1, 1]]
    with pytest.raises(DataError, match=r"ShuffledDataset"):
        BlendedDataset([a, b], [0.5, 0.5], 10)


def _samples(ds, n: int) -> list[list[int]]:
    return [ds[i].tolist() for i in range(n)]


def test_build_datasets_deterministic_and_prefix_stable(make_cfg: Callable[..., DataConfig],
                                                        tokens_prefix: str) -> None:
    cfg = make_cfg(paths=[tokens_prefix, tokens_prefix + ".bin"], weights=[3, 1])
    train, valid, tok = build_datasets(cfg, SEQ, seed=7, n_train=200, n_valid=20)
    assert (len(train), len(valid)) == (200, 20)
    assert tok.vocab_size == 300 and train[0].shape == (SEQ + 1,)
    assert np.bincount(train.dataset_ids).tolist() == [150, 50]
    train2, valid2, _ = build_datasets(cfg, SEQ, seed=7, n_train=80, n_valid=10)
    assert _samples(train2, 80) == _samples(train, 80)
    assert _samples(valid2, 10) == _samples(valid, 10)
    other, _, _ = build_datasets(cfg, SEQ, seed=8, n_train=80, n_valid=10)
    assert _samples(other, 80) != _samples(train, 80)
    assert list((Path(cfg.cache_dir) / "indices").glob("corpus-train-*.npy"))


def test_build_datasets_splits_do_not_overlap(make_cfg: Callable[..., DataConfig],
                                              tokens_prefix: str) -> None:
    t = IndexedTokens(tokens_prefix)
    train, valid, _ = build_datasets(make_cfg(), SEQ, seed=0, n_train=100, n_valid=30)
    boundary = t.doc_offsets[split_ranges(t.n_docs, "75,25")["train"][1]]
    train_packed, valid_packed = train.datasets[0].base, valid.datasets[0].base
    assert train_packed.end == valid_packed.start == boundary
    tokens = np.asarray(t.tokens, dtype=np.int64)
    valid_stream = tokens[boundary:]
    for i in range(30):  # every valid sample really comes from the valid documents
        s = valid[i]
        assert any(np.array_equal(s, valid_stream[j:j + SEQ + 1]) for j in range(0, len(valid_stream), SEQ))


def test_build_datasets_zero_samples(make_cfg: Callable[..., DataConfig]) -> None:
    train, valid, _ = build_datasets(make_cfg(split="100,0"), SEQ, seed=0, n_train=10, n_valid=0)
    assert (len(train), len(valid)) == (10, 0)


def test_weights_length_mismatch(make_cfg: Callable[..., DataConfig]) -> None:
    with pytest.raises(DataError, match=r"data.weights has 2 entries but data.paths has 1"):
        build_datasets(make_cfg(weights=[1, 2]), SEQ, 0, 10, 2)


@pytest.mark.parametrize("weights", [[-1.0], [0.0]])
def test_bad_weights(make_cfg: Callable[..., DataConfig], weights: list[float]) -> None:
    with pytest.raises(DataError, match=r"data.weights"):
        build_datasets(make_cfg(weights=weights), SEQ, 0, 10, 2)


def test_bad_split_in_build(make_cfg: Callable[..., DataConfig]) -> None:
    with pytest.raises(DataError, match=r"data.split"):
        build_datasets(make_cfg(split="98/2"), SEQ, 0, 10, 2)
    with pytest.raises(DataError, match=r"data.split.*valid split.*empty"):
        build_datasets(make_cfg(split="100,0"), SEQ, 0, 10, 2)


def test_tokenizer_smaller_than_token_ids(make_cfg: Callable[..., DataConfig], text_dir: Path,
                                          tmp_path: Path) -> None:
    small = train_bpe(sorted(text_dir.glob("*.txt")), 280, tmp_path / "small.json", show_progress=False)
    with pytest.raises(DataError, match=r"vocabulary of 300.*small.json has 280"):
        build_datasets(make_cfg(tokenizer=str(small)), SEQ, 0, 10, 2)


def test_missing_path(make_cfg: Callable[..., DataConfig], tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"nothere.bin does not exist"):
        build_datasets(make_cfg(paths=[str(tmp_path / "nothere")]), SEQ, 0, 10, 2)
