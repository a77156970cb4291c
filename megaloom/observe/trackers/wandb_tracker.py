"""Weights & Biases: one wandb run per megaloom run directory.

The run's id is derived from the run directory's absolute path, so a resumed megaloom run continues its wandb run
(``resume="allow"``) instead of starting another; wandb keeps one value per step and drops the records of steps it
already has, which a resume trains again. Files go under ``run.dir/wandb``; project = `run.project`; everything
else (entity, offline mode, API key) is wandb's own environment: WANDB_ENTITY, WANDB_MODE=offline, WANDB_API_KEY.
The config logged is the run's resolved config.yaml. Without a login, wandb.init fails at once where stdin is not a
terminal (a job: one warning, the run goes on without W&B) but asks how to proceed in a terminal (wandb's own
prompt): log in first (`wandb login`) or set WANDB_MODE=offline.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from megaloom.observe.trackers.scalars import scalars


def run_id(run_dir: Path) -> str:
    return "megaloom-" + hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:16]


class WandbTracker:
    def __init__(self, run_dir: Path, config: dict, project: str) -> None:
        import wandb

        run_dir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=project, name=run_dir.name, id=run_id(run_dir), resume="allow",
                              dir=str(run_dir), config=config)

    def log(self, record: dict[str, Any], step: int) -> None:
        self.run.log(scalars(record), step=step)

    def close(self) -> None:
        self.run.finish()
