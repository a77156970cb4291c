"""Experiment trackers that mirror metrics.jsonl (`run.trackers`): TensorBoard, Weights & Biases, MLflow.

metrics.jsonl is the contract and is always written (observe/metrics.py); a tracker only mirrors its records: the
same keys, the numbers among them (lists such as per-rank times or per-expert loads stay in metrics.jsonl), at the
record's step, on rank 0 only. Each tracker's package is imported only when the tracker is asked for. A tracker that
cannot start stops the run before its first step, in one line naming the cause and the fix, unless
run.trackers_optional=true (then a warning line, and the run goes on without it); one that fails at a later record
says so in one warning line and is left out from then on (guard.py): a dashboard never stops a run mid-way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from megaloom.observe.trackers.guard import Guarded
from megaloom.observe.trackers.scalars import scalars  # noqa: F401  (its old import path)

TRACKERS = ("tensorboard", "wandb", "mlflow")


class Tracker(Protocol):
    def log(self, record: dict[str, Any], step: int) -> None: ...

    def close(self) -> None: ...


def _opener(name: str, run_dir: Path, config: dict, project: str, mlflow_uri: str) -> Callable[[], Tracker]:
    if name == "tensorboard":
        from megaloom.observe.trackers.tensorboard import TensorBoard

        return lambda: TensorBoard(run_dir)
    if name == "wandb":
        from megaloom.observe.trackers.wandb_tracker import WandbTracker

        return lambda: WandbTracker(run_dir, config, project)
    if name == "mlflow":
        from megaloom.observe.trackers.mlflow_tracker import MlflowTracker

        return lambda: MlflowTracker(run_dir, config, project, mlflow_uri)
    raise ValueError(f"unknown tracker {name!r}; known: {', '.join(TRACKERS)}")


def open_trackers(names: Sequence[str], run_dir: Path, config: dict | None = None, project: str = "megaloom",
                  mlflow_uri: str = "", optional: bool = False) -> list[Guarded]:
    """The trackers ``names`` started now, each behind its guard. One that cannot start raises ConfigError (the
    ones started before it closed again), or with ``optional`` (run.trackers_optional) is already disabled."""
    opened: list[Guarded] = []
    try:
        for name in dict.fromkeys(names):
            opened.append(Guarded(name, _opener(name, run_dir, config or {}, project, mlflow_uri), optional))
    except BaseException:
        for tracker in opened:
            tracker.close()
        raise
    return opened
