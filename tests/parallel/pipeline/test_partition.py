"""Layer partition, schedule choice and micro-batch checks: pure arithmetic, with messages that say what works."""

from __future__ import annotations

import pytest

from megaloom.config import ConfigError, load_config
from megaloom.parallel.pipeline.partition import (
    FIRST_KEY,
    LAST_KEY,
    check_microbatches,
    end_stage_options,
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


def test_interleaved_end_ranks_take_explicit_counts_like_llama3() -> None:
    # Llama 3 405B: 126 layers on 16 pipeline ranks, 7 on each end rank, 8 on the others; with vpp 2 every middle
    # rank holds two chunks of 4, the first rank's embedding chunk 3 (+ 4), the last rank's head chunk 3 (4 +)
    p = partition_layers(126, 16, vpp=2, first_stage_layers=7, last_stage_layers=7)
    per_rank = [sum(len(p.layers(s)) for s in p.stages_of_rank(r)) for r in range(16)]
    assert per_rank == [7] + [8] * 14 + [7]
    assert p.sizes()[0] == 3 and p.sizes()[16] == 4 and p.sizes()[15] == 4 and p.sizes()[31] == 3
    assert set(p.sizes()[1:15]) == {4} and p.starts[-1] == 126
    # the layers stay in model order along the virtual stages (stage s on rank s % pp)
    assert [x for s in range(32) for x in p.layers(s)] == list(range(126))
    # vpp 4: the end rank's 7 as 1 + 2 + 2 + 2 (chunk 0) and 2 + 2 + 2 + 1 (last rank)
    p4 = partition_layers(126, 16, vpp=4, first_stage_layers=7, last_stage_layers=7)
    assert [p4.sizes()[p4.stage_of(0, c)] for c in range(4)] == [1, 2, 2, 2]
    assert [p4.sizes()[p4.stage_of(15, c)] for c in range(4)] == [2, 2, 2, 1]
    # pp 2: only end ranks
    assert partition_layers(7, 2, vpp=2, first_stage_layers=3, last_stage_layers=4).sizes() == [1, 2, 2, 2]


def test_interleaved_end_counts_that_do_not_work_say_what_does() -> None:
    with pytest.raises(ConfigError) as e:
        partition_layers(126, 16, vpp=2)
    assert f"{FIRST_KEY}=7 and {LAST_KEY}=7 (the other ranks take 8 each)" in str(e.value)
    with pytest.raises(ConfigError) as e:
        partition_layers(126, 16, vpp=2, first_stage_layers=7)  # 119 over 15 ranks
    msg = str(e.value)
    assert "end pipeline ranks' layers" in msg and f"{FIRST_KEY}=7 and {LAST_KEY}=7" in msg
    with pytest.raises(ConfigError, match="at least one a chunk"):
        partition_layers(132, 16, vpp=8, first_stage_layers=2, last_stage_layers=2)  # 2 layers for 8 chunks
    with pytest.raises(ConfigError, match="need parallel.pp >= 2"):
        partition_layers(8, 1, vpp=2, first_stage_layers=4)


def test_end_stage_options_for_a_layout_search() -> None:
    assert end_stage_options(80, 8, 2) == [(0, 0)]  # divides: the settings stay at 0
    assert end_stage_options(126, 16, 1) == [(7, 7)] == end_stage_options(126, 16, 2) == end_stage_options(126, 16, 4)
    assert end_stage_options(126, 16, 8) == []  # 8 chunks a rank need 8 layers on the end ranks too
    # DeepSeek-V3's 61 layers on 16 ranks: middle ranks 4, the last rank (head and loss) no heavier than the first
    assert end_stage_options(61, 16, 1) == [(3, 2)]
    assert end_stage_options(4, 4, 2) == []  # fewer layers than chunks
    for n, pp, vpp in ((126, 16, 2), (61, 16, 1), (61, 16, 2), (7, 2, 2), (10, 4, 1), (30, 4, 3)):
        for first, last in end_stage_options(n, pp, vpp):
            partition_layers(n, pp, vpp, first or None, last or None)  # every option is accepted


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
