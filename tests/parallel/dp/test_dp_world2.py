"""One world of 2 processes (dp=2, gloo): ZeRO 0-3 with AdamW and LAMB, clipping, gpt2, qwen3, bert, t5,
checkpoint round trips, each against the single-process run."""

from __future__ import annotations

import pytest

from ..harness import run_world
from .checks import assert_case
from .dp_worlds import suite_dp2

CASES = ["z0-adamw", "z1-adamw", "z2-adamw", "z3-adamw", "z1-adamw-clip", "z2-adamw-clip", "z3-adamw-clip",
         "z0-lamb", "z1-lamb", "z2-lamb", "z3-lamb", "z1-gpt2", "z1-qwen3", "z1-bert", "z1-t5", "z1-roundtrip",
         "z3-roundtrip", "z2-lamb-roundtrip"]


@pytest.fixture(scope="module")
def world() -> list[dict]:
    return run_world(2, suite_dp2)


def test_every_case_ran(world: list[dict]) -> None:
    assert sorted(world[0]) == sorted(CASES)


@pytest.mark.parametrize("case", CASES)
def test_dp2_matches_single_process(world: list[dict], case: str) -> None:
    for res in world:
        assert_case(res[case])
