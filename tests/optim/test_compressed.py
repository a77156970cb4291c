"""The error-compensated 1-bit exchange (megaloom/optim/compressed.py) in one process: sign bits packed 8 to a
byte, the chunk plan, one scale per piece. Over several ranks, 1,000 steps against a float64 reference:
dp/test_dp_world2.py."""

from __future__ import annotations

import pytest
import torch

from megaloom.optim.compressed import ChunkPlan, CompressedAverage, pack_signs, unpack_signs


def test_signs_pack_eight_to_a_byte_first_element_highest() -> None:
    bits = torch.tensor([1, 0, 0, 0, 0, 0, 0, 1, 0, 1, 0, 0, 0, 0, 0, 0], dtype=torch.bool)
    packed = pack_signs(bits)
    assert packed.dtype == torch.uint8 and packed.tolist() == [0b10000001, 0b01000000]
    assert unpack_signs(packed).tolist() == [1.0 if b else -1.0 for b in bits.tolist()]
    many = torch.rand(8 * 1000) > 0.5
    assert torch.equal(unpack_signs(pack_signs(many)) > 0, many)


def test_chunk_plan_cuts_pieces_at_parameters_and_chunks() -> None:
    plan = ChunkPlan(64, 2, [0, 10, 40, 50], torch.device("cpu"))  # chunks [0, 32), [32, 64)
    assert list(zip(plan.starts, plan.lengths, strict=True)) == [(0, 10), (10, 22), (32, 8), (40, 10), (50, 14)]
    assert plan.count == [2, 3] and plan.s_max == 3 and plan.row == 32 // 8 + 4 * 3
    with pytest.raises(ValueError, match="multiple of 8 x ranks"):
        ChunkPlan(60, 2, [], torch.device("cpu"))


@pytest.mark.parametrize("ranks,bounds", [(1, []), (2, [3, 40, 41]), (4, [8, 9, 10, 63, 64, 65, 100])])
def test_expand_repeats_each_segment_scale_over_its_elements(ranks: int, bounds: list[int]) -> None:
    plan = ChunkPlan(8 * ranks * 5, ranks, bounds, torch.device("cpu"))
    scales = torch.randn(plan.s_max + 2)  # a message row holds s_max scales: the first count[r] are chunk r's
    for r in range(ranks):
        lengths = torch.tensor([plan.lengths[i] for i in plan.segments(r)])
        want = torch.repeat_interleave(scales[:plan.count[r]], lengths)
        assert torch.equal(plan.expand(scales, r), want)


def test_one_rank_exchange_keeps_each_piece_norm_and_zeros_exact() -> None:
    """One scale per piece, the piece's root mean square (so the compressed piece keeps its L2 norm); a piece of
    zeros (padding) stays exactly zero, and so do its errors."""
    plan = ChunkPlan(64, 1, [0, 10, 40, 48], torch.device("cpu"))
    ex = CompressedAverage(plan, None, torch.device("cpu"))
    x = torch.randn(64, generator=torch.Generator().manual_seed(0))
    x[10:40] *= 100
    x[48:] = 0
    out = ex(x.clone(), torch.empty(64))
    for a, b in ((0, 10), (10, 40), (40, 48)):
        assert torch.allclose(out[a:b].abs(), x[a:b].norm() / (b - a) ** 0.5)
        assert torch.equal(out[a:b] > 0, x[a:b] >= 0)
    assert not out[48:].any() and not ex.worker_error[48:].any() and not ex.server_error[48:].any()
    assert torch.allclose(ex.worker_error + out, x, atol=1e-4)  # what was not sent is kept for the next exchange
