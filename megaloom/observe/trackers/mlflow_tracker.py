"""MLflow: one MLflow run per megaloom run directory, in the experiment `run.project`.

The run is found again by its ``megaloom.run_dir`` tag (the directory's absolute path), so a resumed megaloom run
logs into the run it started; MLflow keeps every value it is sent, so the steps a resume trains again appear twice
at their step. The tracking URI is `run.mlflow_uri`, else MLFLOW_TRACKING_URI, else MLflow's default. Parameters:
the resolved config flattened to ``section.key`` (logged when the run is created: MLflow refuses to change them).
Calls go through an `MlflowClient`, not the module-level active run, so nothing global is left behind.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from megaloom.observe.trackers.scalars import scalars

TAG = "megaloom.run_dir"
BATCH = 100  # MLflow's limit of parameters per log_batch call


def flat_params(config: dict) -> dict[str, str]:
    out = {}
    for section, body in config.items():
        for key, value in (body or {}).items():
            out[f"{section}.{key}"] = str(value)[:500]  # MLflow's longest parameter value
    return out


class MlflowTracker:
    def __init__(self, run_dir: Path, config: dict, project: str, uri: str) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = client = MlflowClient(tracking_uri=uri or None)
        exp = client.get_experiment_by_name(project)
        exp_id = exp.experiment_id if exp is not None else client.create_experiment(project)
        where = str(run_dir.resolve())
        found = client.search_runs([exp_id], filter_string=f"tags.`{TAG}` = '{where}'", max_results=1)
        if found:
            self.run_id = found[0].info.run_id
            client.update_run(self.run_id, status="RUNNING")
        else:
            self.run_id = client.create_run(exp_id, run_name=run_dir.name, tags={TAG: where}).info.run_id
            params = [Param(k, v) for k, v in flat_params(config).items()]
            for i in range(0, len(params), BATCH):
                client.log_batch(self.run_id, params=params[i:i + BATCH])

    def log(self, record: dict[str, Any], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, step) for k, v in scalars(record).items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)
