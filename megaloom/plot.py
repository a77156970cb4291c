"""`megaloom plot RUN_DIR`: the loss curve (train and validation) as a PNG."""

from __future__ import annotations

from pathlib import Path

from megaloom.observe.metrics import read_metrics


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
    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    ax.plot(*zip(*train, strict=True), label="train loss", lw=1.2)
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
    return out
