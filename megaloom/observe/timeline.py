"""Pipeline timelines as pictures: a PNG (ranks as rows, one coloured box per computation, the micro-batch
inside, bubble fraction in the title) and a Chrome-trace JSON for Perfetto / chrome://tracing (one row per
rank). The timeline is either planned (`megaloom.parallel.pipeline.checker.simulate`, in unit steps) or
measured (the executor's timers, in seconds).

`schedule_command` is ``megaloom schedule --pp 4 --vpp 2 --microbatches 8 --schedule interleaved --out x.png``.
"""

from __future__ import annotations

import json
from pathlib import Path

from megaloom.config import ConfigError
from megaloom.parallel.pipeline.timing import COMPUTE_KINDS, Timeline

COLOURS = {"F": "#4c72b0", "B": "#55a868", "BI": "#8fd19e", "BW": "#dd8452", "COMM": "#bbbbbb"}


def _title(tl: Timeline) -> str:
    return (f"{tl.name}: pp={tl.pp} vpp={tl.vpp} micro-batches={tl.microbatches} | "
            f"bubble {100 * tl.bubble_fraction:.1f}% of rank time")


def chunk_alpha(tl: Timeline, chunk: int) -> float:
    """Later model chunks (interleaved schedule) are drawn in lighter shades of their kind's colour."""
    return 1.0 - 0.45 * chunk / max(tl.vpp - 1, 1)


def legend_entries(tl: Timeline) -> list[tuple[str, str, float]]:
    """(label, colour, alpha): one per kind of action drawn, then, with vpp > 1, one grey shade per model chunk
    so that the picture's lighter bars are explained."""
    kinds = sorted({a.kind for rank in tl.ranks for a in rank}, key=list(COLOURS).index)
    entries = [(k, COLOURS[k], 1.0) for k in kinds]
    if tl.vpp > 1:
        entries += [(f"chunk {c}", "#555555", chunk_alpha(tl, c)) for c in range(tl.vpp)]
    return entries


def render_png(tl: Timeline, path: str | Path, title: str | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    path = Path(path)
    span = tl.makespan or 1.0
    fig, ax = plt.subplots(figsize=(min(40.0, max(8.0, 0.35 * span + 2) if tl.unit == "step" else 14.0),
                                    0.55 * len(tl.ranks) + 1.6))
    for r, actions in enumerate(tl.ranks):
        y = len(tl.ranks) - 1 - r  # rank 0 on top
        for a in actions:
            comm = a.kind not in COMPUTE_KINDS
            height = 0.3 if comm else 0.8
            # Later model chunks (interleaved schedule) in lighter shades of their kind's colour.
            alpha = chunk_alpha(tl, a.stage // tl.pp if a.stage >= 0 else 0)
            ax.broken_barh([(a.start - tl.start, a.end - a.start)], (y - height / 2, height),
                           facecolors=COLOURS.get(a.kind, "#999999"), edgecolor="white", linewidth=0.5, alpha=alpha)
            if not comm and (a.end - a.start) >= 0.02 * span:
                ax.text((a.start + a.end) / 2 - tl.start, y, str(a.microbatch), ha="center", va="center",
                        fontsize=7, color="white" if a.kind in ("F", "B") else "black")
    ax.set_yticks(range(len(tl.ranks)), [f"rank {r}" for r in reversed(range(len(tl.ranks)))])
    ax.set_xlim(0, span)
    ax.set_xlabel("time (unit = one forward)" if tl.unit == "step" else "seconds")
    entries = legend_entries(tl)
    ax.legend(handles=[Patch(color=c, alpha=al, label=lb) for lb, c, al in entries], loc="upper right", fontsize=7,
              ncol=len(entries), bbox_to_anchor=(1.0, 1.0 + 0.9 / (0.55 * len(tl.ranks) + 1.6)))
    ax.set_title(title or _title(tl), fontsize=9, loc="left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def chrome_trace(tl: Timeline) -> dict:
    """The Chrome trace-event form: one thread per rank, complete ("X") events in microseconds."""
    scale = 1e6 if tl.unit == "s" else 1e3  # a planned unit step is drawn as 1 ms
    events: list[dict] = [{"name": "process_name", "ph": "M", "pid": 0, "args": {"name": _title(tl)}}]
    for r, actions in enumerate(tl.ranks):
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": r, "args": {"name": f"rank {r}"}})
        for a in actions:
            name = f"{a.kind} {a.microbatch}" if a.kind in COMPUTE_KINDS else a.kind
            events.append({"name": name, "cat": a.kind, "ph": "X", "pid": 0, "tid": r,
                           "ts": (a.start - tl.start) * scale, "dur": (a.end - a.start) * scale,
                           "args": {"microbatch": a.microbatch, "stage": a.stage, "detail": a.label}})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"bubble_fraction": tl.bubble_fraction, "unit": tl.unit}}


def write_chrome_trace(tl: Timeline, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(chrome_trace(tl)))
    return path


def merge_timelines(per_rank: list[Timeline]) -> Timeline:
    """Each rank's measured timeline (`PipelineExecutor.timeline()`, gathered by the caller) as one."""
    first = per_rank[0]
    ranks = [tl.ranks[r] for r, tl in enumerate(per_rank)]
    return Timeline(first.name, first.pp, first.vpp, first.microbatches, ranks, first.unit)


def schedule_command(pp: int, vpp: int, microbatches: int, schedule: str, out: str | Path | None) -> int:
    """Build, check and simulate a schedule; print its bubble beside Megatron's (p - 1) / (v m); draw it to
    ``out`` (.png, or .json for a Chrome trace). Returns the exit code."""
    from megaloom.parallel.pipeline.checker import check_schedule, simulate
    from megaloom.parallel.pipeline.schedules import build_schedule

    sc = build_schedule(schedule, pp, vpp, microbatches)
    check_schedule(sc)
    tl = simulate(sc)
    theory = (pp - 1) / (vpp * microbatches)
    print(f"{schedule} pp={pp} vpp={vpp} micro-batches={microbatches}: schedule checked (dependencies, message "
          f"order, no deadlock)")
    print(f"bubble: {100 * tl.bubble_fraction:.1f}% of rank time idle; idle/compute = {tl.bubble_ratio:.3f} "
          f"(theory (p-1)/(v*m) = {pp - 1}/({vpp}*{microbatches}) = {theory:.3f})")
    print(f"activations held per rank (micro-batch x stage chunks): {tl.peak_activations}")
    if out is not None:
        out = Path(out)
        if out.suffix == ".png":
            render_png(tl, out)
        elif out.suffix == ".json":
            write_chrome_trace(tl, out)
        else:
            raise ConfigError(f"--out {out}: use a .png (picture) or .json (Chrome trace for Perfetto) file.")
        print(f"wrote {out}")
    return 0
