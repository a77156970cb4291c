"""Layer partition, schedule choice and micro-batch checks: pure arithmetic, with messages that say what works."""

from __future__ import annotations

import pytest

from megaloom.config import ConfigError, load_config
from megaloom.parallel.pipeline.partition import (
    FIRST_KEY,
    LAST_KEY,
    check_microbatches,
    partition_layers,
    validate_pipeline,
)


def test_even_split_and_interleaved_placement() -> None:
    p = partition_layers(8, pp=2, vpp=2)
    assert p.sizes() == [2, 2, 2, 2]
    assert [list(p.layers(s)) for s in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    # rank r holds chunks r, r + pp: rank 0 runs stages 0 and 2, rank 1 stages 1 and 3
    assert p.stages_of_rank(0) == (0, 2) and p.stages_of_rank(1) == (1, 3)
    assert [p.rank_of(s) for s in range(4)] == [0, 1, 0, 1]
    assert p.chunk_of(3) == 1 and p.stage_of(1, 1) == 3
    assert partition_layers(4, 1).sizes() == [4]


def test_explicit_first_and_last_stage() -> None:
    assert partition_layers(10, 4, first_stage_layers=2, last_stage_layers=2).sizes() == [2, 3, 3, 2]
    assert partition_layers(10, 4, first_stage_layers=1).sizes() == [1, 3, 3, 3]
    assert partition_layers(9, 4, last_stage_layers=0).sizes() == [3, 3, 3, 0]  # the last stage: head + loss only
    assert partition_layers(5, 2, first_stage_layers=2).sizes() == [2, 3]


def test_uneven_layers_say_what_works() -> None:
    with pytest.raises(ConfigError) as e:
        partition_layers(10, 4)
    msg = str(e.value)
    assert "model.n_layers=10" in msg and "parallel.pp*vpp" in msg and "model.n_layers=8 or 12" in msg
    assert f"{FIRST_KEY}=2 and {LAST_KEY}=2" in msg  # 2 + 3 + 3 + 2
    partition_layers(10, 4, first_stage_layers=2, last_stage_layers=2)  # ... which does work
    with pytest.raises(ConfigError, match=f"{FIRST_KEY}=2 leave"):
        partition_layers(10, 4, first_stage_layers=2)  # 8 layers do not split over 3 stages
    with pytest.raises(ConfigError, match="between 0 and model.n_layers=10"):
        partition_layers(10, 4, first_stage_layers=11)


def test_vpp_needs_enough_layers() -> None:
    with pytest.raises(ConfigError, match="parallel.vpp=2 with parallel.pp=4 makes 8 virtual stages.*"
                                          "parallel.vpp=1 would work"):
        partition_layers(4, 4, vpp=2)


def test_microbatches_fit_the_schedule() -> None:
    assert check_microbatches("1f1b", 4, 1, global_batch_size=6, micro_batch_size=2) == 3  # any count
    assert check_microbatches("interleaved", 4, 2, global_batch_size=16, micro_batch_size=2) == 8
    with pytest.raises(ConfigError) as e:
        check_microbatches("interleaved", 4, 2, global_batch_size=12, micro_batch_size=2)
    msg = str(e.value)
    assert "= 6" in msg and "multiple of parallel.pp=4" in msg and "train.global_batch_size=8 or 16" in msg
    with pytest.raises(ConfigError, match="parallel.vpp=2 needs parallel.schedule=interleaved"):
        check_microbatches("1f1b", 4, 2, 16, 2)
    with pytest.raises(ConfigError, match="choose one of gpipe, 1f1b, interleaved, zb"):
        check_microbatches("pipedream", 4, 1, 16, 2)
    with pytest.raises(ConfigError, match="no micro-batch"):
        check_microbatches("1f1b", 2, 1, global_batch_size=2, micro_batch_size=2, dp=2)


def test_validate_pipeline_from_config() -> None:
    cfg = load_config(None, ["model.n_layers=8", "parallel.pp=2", "parallel.vpp=2", "parallel.schedule=interleaved",
                             "train.micro_batch_size=1", "train.global_batch_size=8"])
    assert validate_pipeline(cfg, dp=2).sizes() == [2, 2, 2, 2]  # 4 micro-batches per replica: a multiple of 2
    with pytest.raises(ConfigError, match="multiple of parallel.pp=2"):
        validate_pipeline(cfg, dp=8)  # 1 micro-batch per replica
