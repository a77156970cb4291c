"""`megaloom train`: `train(cfg)` builds a `Trainer` (megaloom/training/) and runs it to the last step.

The names tests, benchmarks and other modules import from here stay here: `train`, `TrainResult`,
`apply_train_options`, `resolve_model_shape`, `evaluate`, `evaluate_pipeline`, `load_run_config`.
"""

from __future__ import annotations

from pathlib import Path

from megaloom.config import Config, ConfigError
from megaloom.training.evaluate import evaluate, evaluate_pipeline
from megaloom.training.options import apply_train_options
from megaloom.training.resolve import resolve_model_shape
from megaloom.training.trainer import Trainer, TrainResult

__all__ = ["TrainResult", "Trainer", "apply_train_options", "evaluate", "evaluate_pipeline", "load_run_config",
           "resolve_model_shape", "train"]


def train(cfg: Config, stop_after: int | None = None) -> TrainResult:
    """Train per `cfg` (which is not changed). `stop_after` ends the process's work after that step as a
    preemption would (tests)."""
    return Trainer(cfg).build().fit(stop_after=stop_after)


def load_run_config(run_dir: Path) -> Config:
    from megaloom.config import config_from_dict, load_yaml

    path = run_dir / "config.yaml"
    if not path.is_file():
        raise ConfigError(f"--run {run_dir}: no config.yaml there (is it a megaloom run directory?).")
    data = load_yaml(path, "--run")
    if not isinstance(data, dict):
        raise ConfigError(f"--run {path}: expected a mapping of sections (model:, train:, ...).")
    return config_from_dict(data)
