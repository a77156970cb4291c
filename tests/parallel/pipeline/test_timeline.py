"""Planned timelines drawn as PNG and Chrome trace; `megaloom schedule`'s command function."""

from __future__ import annotations

import json

import pytest

from megaloom.config import ConfigError
from megaloom.observe.timeline import chrome_trace, render_png, schedule_command
from megaloom.parallel.pipeline.checker import simulate
from megaloom.parallel.pipeline.schedules import interleaved, zero_bubble_h1


def test_png_and_chrome_trace(tmp_path) -> None:
    tl = simulate(interleaved(4, 2, 8))
    png = render_png(tl, tmp_path / "plan.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    trace = chrome_trace(simulate(zero_bubble_h1(2, 4)))
    boxes = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["tid"] for e in boxes} == {0, 1}
    assert sum(e["name"].startswith("BW") for e in boxes) == 8  # 4 micro-batches x 2 stages
    assert trace["otherData"]["bubble_fraction"] == pytest.approx(simulate(zero_bubble_h1(2, 4)).bubble_fraction)
    json.dumps(trace)


def test_schedule_command(tmp_path, capsys) -> None:
    assert schedule_command(4, 2, 8, "interleaved", tmp_path / "x.png") == 0
    out = capsys.readouterr().out
    assert "bubble: 15.8% of rank time idle; idle/compute = 0.188 (theory (p-1)/(v*m) = 3/(2*8) = 0.188)" in out
    assert (tmp_path / "x.png").stat().st_size > 1000
    assert schedule_command(4, 1, 8, "1f1b", tmp_path / "x.json") == 0
    assert json.loads((tmp_path / "x.json").read_text())["traceEvents"]
    with pytest.raises(ConfigError, match="--out"):
        schedule_command(2, 1, 2, "gpipe", tmp_path / "x.svg")
    with pytest.raises(ConfigError, match="multiple of parallel.pp=4"):
        schedule_command(4, 2, 6, "interleaved", None)


def test_interleaved_legend_explains_the_chunk_shades() -> None:
    """Issue 24 (9): the interleaved picture draws later chunks lighter; the legend now says which is which."""
    from megaloom.observe.timeline import chunk_alpha, legend_entries

    tl = simulate(interleaved(2, 2, 4))
    labels = [e[0] for e in legend_entries(tl)]
    assert labels[-2:] == ["chunk 0", "chunk 1"]
    assert legend_entries(tl)[-1][2] == chunk_alpha(tl, 1) < chunk_alpha(tl, 0) == 1.0
