"""`megaloom plot RUN_DIR`: the loss curve (train and validation) as a PNG. `megaloom plot A B [C ...]`: several runs
overlaid, with each one's gap to the first in percent (precision or layout comparisons, e.g. fp8 against bf16)."""

from __future__ import annotations

from pathlib import Path

from megaloom.observe.metrics import read_metrics


def _label(source: Path) -> str:
    return source.stem.removeprefix("metrics_") if source.is_file() else source.name


def compare_runs(sources: list[str | Path], out: str | Path | None = None) -> Path:
    """Train-loss curves of several runs (directories or metrics .jsonl files) on one axis, and below them each
    run's relative difference to the first at the steps both logged. Writes ``out`` (default: compare.png beside
    the first run)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = [Path(s) for s in sources]
    curves = {}
    for p in paths:
        # a null loss is a non-finite step (metrics.jsonl writes NaN as null): no point on the curve
        train = {r["step"]: r["loss"] for r in read_metrics(p) if r.get("loss") is not None}
        if not train:
            raise ValueError(f"{p}: no logged training loss to plot (a run directory or a metrics .jsonl file).")
        curves[_label(p)] = train
    first = paths[0]
    out = Path(out) if out else (first.parent if first.is_file() else first) / "compare.png"
    fig = compare_figure(curves)
    fig.savefig(out)
    plt.close(fig)
    return out


def _marker(n_points: int) -> str | None:
    """A line through one point draws nothing: short curves get markers so that every run is visible."""
    return "o" if n_points < 3 else None


def compare_figure(curves: dict[str, dict[int, float]]):
    """The figure of `compare_runs`: losses on top, each run's gap (%) to the first below."""
    import matplotlib.pyplot as plt

    fig, (ax, gap) = plt.subplots(2, 1, figsize=(8, 6.5), dpi=110, sharex=True, height_ratios=(2, 1))
    ref_name, ref = next(iter(curves.items()))
    for name, c in curves.items():
        steps = sorted(c)
        (line,) = ax.plot(steps, [c[s] for s in steps], label=name, lw=1.2, marker=_marker(len(steps)))
        if name != ref_name:  # the same colour in both panels
            common = [s for s in steps if s in ref]
            gap.plot(common, [100 * (c[s] - ref[s]) / ref[s] for s in common], label=f"{name} vs {ref_name}", lw=1.2,
                     color=line.get_color(), marker=_marker(len(common)))
    ax.set_ylabel("train loss (nats/token)")
    ax.set_title("megaloom: " + ", ".join(curves))
    ax.grid(alpha=0.3)
    ax.legend()
    gap.axhline(0, color="black", lw=0.6)
    gap.set_xlabel("step")
    gap.set_ylabel(f"gap to {ref_name} (%)")
    gap.grid(alpha=0.3)
    if len(curves) > 1:
        gap.legend()
    fig.tight_layout()
    return fig


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    records = read_metrics(run_dir)
    if not records:
        raise ValueError(f"{run_dir}: no metrics.jsonl with records to plot (has the run logged a step yet?).")
    out = Path(out) if out else run_dir / "loss.png"
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    # a null loss (a non-finite step) is drawn as a gap in the curve
    train = [(r["step"], float("nan") if r["loss"] is None else r["loss"]) for r in records if "loss" in r]
    ax.plot(*zip(*train, strict=True), label="train loss", lw=1.2, marker=_marker(len(train)))
    ev = [(r["step"], r["eval_loss"]) for r in records if r.get("eval_loss") is not None]
    if ev:
        ax.plot(*zip(*ev, strict=True), "o-", label="validation loss", lw=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(f"megaloom: {run_dir.name}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    moe = [r["moe_tokens_per_expert"] for r in records if r.get("moe_tokens_per_expert")]
    if moe:
        plot_expert_load(moe, run_dir / "expert_load.png", run_dir.name)
    return out


def plot_expert_load(per_record: list[list[list[float]]], out: Path, title: str) -> Path:
    """Heat map of MoE load: rows are MoE layers, columns experts, colour the share of routed tokens (averaged
    over the logged steps); a balanced router is one flat colour at 1/n_experts."""
    import matplotlib.pyplot as plt
    import numpy as np

    load = np.asarray(per_record, dtype=np.float64)  # [records, layers, experts]
    share = (load / np.clip(load.sum(-1, keepdims=True), 1e-9, None)).mean(0)
    fig, ax = plt.subplots(figsize=(1.2 + 0.45 * share.shape[1], 1.2 + 0.45 * share.shape[0]), dpi=110)
    im = ax.imshow(share, cmap="viridis", aspect="auto")
    ax.set_xlabel("expert")
    ax.set_ylabel("MoE layer")
    ax.set_xticks(range(share.shape[1]))
    ax.set_yticks(range(share.shape[0]))
    ax.set_title(f"{title}: share of routed tokens per expert (balanced = {1 / share.shape[1]:.3f})")
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out
