"""The data index at scale: memory-mapped (never loaded), written by one process, skipped by middle pipeline
stages, and the vectorised blend equal to the sequential rule sample for sample."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import megaloom.data.blend as blend
from megaloom.config import DataConfig
from megaloom.data.blend import blend_plan, normalize_weights
from megaloom.data.dataset import SizeOnly, build_datasets
from megaloom.data.indexed import IndexedTokens
from tests.parallel.harness import run_world

SEQ = 16


def _sequential_plan(weights: list[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """The rule one sample at a time, as megaloom computed it before the vectorised version (the reference)."""
    w = normalize_weights(weights)
    counts, ids, local = [0] * len(w), [], []
    for i in range(size):
        t = i + 1
        best, best_err = 0, w[0] * t - counts[0]
        for d in range(1, len(w)):
            err = w[d] * t - counts[d]
            if err > best_err:
                best, best_err = d, err
        ids.append(best)
        local.append(counts[best])
        counts[best] += 1
    return np.asarray(ids, dtype=np.int64), np.asarray(local, dtype=np.int64)


def test_vectorised_blend_equals_the_sequential_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    # Short segments and blocks so that small plans cross many of both (the paths a 1T-token plan takes).
    monkeypatch.setattr(blend, "SEGMENT", 64)
    monkeypatch.setattr(blend, "SEGMENTS_PER_BLOCK", 8)
    rng = np.random.default_rng(0)
    cases = [([0.5, 0.3, 0.2], 3000), ([1, 1], 777), ([1, 1, 1, 1, 1, 1, 1], 2500), ([3, 1], 1), ([1, 2], 0),
             ([1e-4, 1, 1e3], 4000), ([0.1] * 10, 3001)]
    cases += [(list(rng.random(int(rng.integers(2, 9)))), int(rng.integers(1, 6000))) for _ in range(12)]
    for weights, size in cases:
        ids, local = blend_plan(weights, size)
        ref_ids, ref_local = _sequential_plan(weights, size)
        np.testing.assert_array_equal(ids, ref_ids, err_msg=f"{weights} x {size}")
        np.testing.assert_array_equal(local, ref_local, err_msg=f"{weights} x {size}")


def test_indices_are_memory_mapped_and_reused(make_cfg: Callable[..., DataConfig], tokens_prefix: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    t = IndexedTokens(tokens_prefix)
    assert isinstance(t.doc_offsets, np.memmap) and isinstance(t.tokens, np.memmap)  # .idx and .bin: mapped
    cfg = make_cfg(paths=[tokens_prefix, tokens_prefix + ".bin"], weights=[3, 1])
    train, _, _ = build_datasets(cfg, SEQ, seed=7, n_train=200, n_valid=20)
    assert isinstance(train.dataset_ids, np.memmap) and isinstance(train.local_ids, np.memmap)
    assert all(isinstance(d.index, np.memmap) for d in train.datasets)
    first = [train[i].tolist() for i in range(200)]

    def rebuilt(*_: object, **__: object) -> None:
        raise AssertionError("an index was written again although the cache holds it")

    monkeypatch.setattr("megaloom.data.shuffle.npy_writer", rebuilt)
    monkeypatch.setattr("megaloom.data.blend.npy_writer", rebuilt)
    again, _, _ = build_datasets(cfg, SEQ, seed=7, n_train=200, n_valid=20)
    assert [again[i].tolist() for i in range(200)] == first


def test_middle_stage_builds_nothing(make_cfg: Callable[..., DataConfig]) -> None:
    cfg = make_cfg()
    train, valid, tok = build_datasets(cfg, SEQ, seed=0, n_train=100, n_valid=10, reads_data=False)
    assert isinstance(train, SizeOnly) and (len(train), len(valid)) == (100, 10) and tok.vocab_size == 300
    assert not (Path(cfg.cache_dir) / "indices").exists()
    with pytest.raises(RuntimeError, match="reads no tokens"):
        train[0]


def _world_builds(rank: int, world: int, device: object, cfg: DataConfig) -> dict:
    """Rank r of a 4-rank world on two 'nodes' (local ranks 0, 1): ranks 0, 1, 2 read data, rank 3 is a middle
    stage. Returns the files this rank wrote and the first samples it sees."""
    import megaloom.data.blend as blend_mod
    import megaloom.data.shuffle as shuffle_mod
    from megaloom.parallel.host_group import HostGroup
    from megaloom.runtime import Runtime
    from megaloom.training.data import load_rank_datasets

    wrote: list[str] = []
    for mod in (blend_mod, shuffle_mod):
        real = mod.npy_writer

        def counting(path, *a, _real=real, **k):
            wrote.append(Path(path).name)
            return _real(path, *a, **k)

        mod.npy_writer = counting
    rt = Runtime(device=device, rank=rank, world_size=world, local_rank=rank % 2)
    train, _, _ = load_rank_datasets(None, cfg, SEQ, 3, 64, 8, rt, reads_data=rank != 3, host=HostGroup(60))
    return {"wrote": wrote, "rows": None if rank == 3 else [train[i].tolist() for i in range(8)],
            "kind": type(train).__name__}


def test_one_process_writes_the_index_for_the_world(make_cfg: Callable[..., DataConfig], tokens_prefix: str) -> None:
    cfg = make_cfg(paths=[tokens_prefix, tokens_prefix + ".bin"], weights=[3, 1])
    out = run_world(4, _world_builds, cfg)
    assert sorted(out[0]["wrote"]) and all(not r["wrote"] for r in out[1:])  # rank 0 wrote; the others mapped
    assert len(out[0]["wrote"]) == 8  # train and valid: a blend plan (ids, local) and two shuffled indices each
    assert out[1]["rows"] == out[2]["rows"] == out[0]["rows"]
    assert out[3]["kind"] == "SizeOnly"
