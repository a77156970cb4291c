"""One world of 4 processes (gloo): dp=4 with ZeRO 0-3, and tp=2 x dp=2 (also with sequence parallelism and
LAMB), each against the single-process run."""

from __future__ import annotations

import pytest

from ..harness import run_world
from .checks import assert_case
from .dp_worlds import suite_dp4

CASES = ["dp4-z0", "dp4-z1", "dp4-z2", "dp4-z3", "dp4-z2-clip", "dp4-z1-lamb", "tp2dp2-z0", "tp2dp2-z1",
         "tp2dp2-z2", "tp2dp2-z3", "tp2dp2-z1-sp", "tp2dp2-z0-lamb", "tp2dp2-z2-lamb", "tp2dp2-z1-roundtrip",
         "tp2dp2-z1-sp-fused", "tp2dp2-z3-model-only"]


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> list[dict]:
    return run_world(4, suite_dp4, str(tmp_path_factory.mktemp("suite_dp4")))


def test_every_case_ran(world: list[dict]) -> None:
    assert sorted(world[0]) == sorted(CASES)


@pytest.mark.parametrize("case", CASES)
def test_world4_matches_single_process(world: list[dict], case: str) -> None:
    for res in world:
        assert_case(res[case])
