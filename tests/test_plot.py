"""`megaloom plot A B ...`: runs overlaid with each one's gap to the first."""

from __future__ import annotations

import json

import pytest

from megaloom.cli import main
from megaloom.plot import compare_runs


def _metrics(path, losses) -> None:
    path.write_text("\n".join(json.dumps({"step": 10 * (i + 1), "loss": x}) for i, x in enumerate(losses)))


def test_compare_runs_from_metrics_files_and_run_dirs(tmp_path, capsys) -> None:
    _metrics(tmp_path / "metrics_bf16.jsonl", [6.0, 5.0, 4.0])
    _metrics(tmp_path / "metrics_fp8.jsonl", [6.1, 5.1, 4.1])
    run = tmp_path / "run"
    run.mkdir()
    _metrics(run / "metrics.jsonl", [6.0, 4.9])  # a run directory, fewer logged steps: compared where both logged
    out = compare_runs([tmp_path / "metrics_bf16.jsonl", tmp_path / "metrics_fp8.jsonl", run])
    assert out == tmp_path / "compare.png" and out.stat().st_size > 1000
    assert main(["plot", str(tmp_path / "metrics_bf16.jsonl"), str(run), "--out", str(tmp_path / "c.png")]) == 0
    assert (tmp_path / "c.png").stat().st_size > 1000 and "wrote" in capsys.readouterr().out
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no logged training loss"):
        compare_runs([run, tmp_path / "empty"])


def test_a_one_point_run_is_visible_in_a_comparison() -> None:
    """Issue 24 (9): a run that logged one step was a line through one point (nothing drawn)."""
    import matplotlib.pyplot as plt

    from megaloom.plot import compare_figure

    fig = compare_figure({"long": {10: 6.0, 20: 5.0, 30: 4.0}, "short": {10: 6.1}})
    top, gap = fig.axes
    assert [line.get_marker() for line in top.lines] == ["None", "o"]
    assert gap.lines[0].get_marker() == "o"  # the gap of the short run (then the zero line)
    plt.close(fig)
