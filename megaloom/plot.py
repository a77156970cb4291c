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
