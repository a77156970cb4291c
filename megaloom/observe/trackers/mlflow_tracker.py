"""MLflow: one MLflow run per megaloom run directory, in the experiment `run.project`.

The run is found again by its ``megaloom.run_dir`` tag (the directory's absolute path), so a resumed megaloom run
logs into the run it started; MLflow keeps every value it is sent, so the steps a resume trains again appear twice
at their step. The tracking URI is `run.mlflow_uri`, else MLFLOW_TRACKING_URI, else a SQLite database in the run
directory, ``sqlite:///<run.dir>/mlflow.db`` (artifacts under run.dir/mlartifacts): current MLflow (3.x) keeps its
file store (``file:/path/mlruns``) in maintenance mode and refuses it unless MLFLOW_ALLOW_FILE_STORE=true, and its
own default (./mlflow.db) would land wherever training was started. `mlflow ui --backend-store-uri
sqlite:///<run.dir>/mlflow.db` shows it. A SQLite store needs SQLAlchemy and Alembic, which the megaloom[mlflow]
extra installs beside mlflow-skinny (without them MLflow says only "unsupported URI"). Parameters:
the resolved config flattened to ``section.key`` (logged when the run is created: MLflow refuses to change them).
Calls go through an `MlflowClient`, not the module-level active run, so nothing global is left behind.
"""

from __future__ import annotations

import importlib.util
import os
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


def tracking_uri(uri: str, run_dir: Path) -> tuple[str, bool]:
    """(the tracking URI, whether it is megaloom's default store in the run directory)."""
    uri = uri or os.environ.get("MLFLOW_TRACKING_URI", "")
    if uri:
        return uri, False
    return f"sqlite:///{(run_dir / 'mlflow.db').resolve()}", True


def _check_store(uri: str) -> None:
    """A SQLite store without SQLAlchemy / Alembic, which MLflow refuses as an "unsupported URI": said as what is
    missing (the guard adds the pip line)."""
    if uri.startswith("sqlite:"):
        missing = [m for m in ("sqlalchemy", "alembic") if importlib.util.find_spec(m) is None]
        if missing:
            raise ImportError(f"MLflow's SQLite store {uri} needs {' and '.join(missing)}, which mlflow-skinny "
                              "does not install")


def _is_file_store(uri: str) -> bool:
    return uri.startswith("file:") or "://" not in uri  # a plain path is a file store too


FILE_STORE_FIX = ("run.mlflow_uri={uri} is MLflow's file store, which current MLflow refuses (maintenance mode): "
                  "use a database (leave run.mlflow_uri empty for run.dir/mlflow.db, or sqlite:////abs/path/mlflow.db, "
                  "or a tracking server), or set MLFLOW_ALLOW_FILE_STORE=true to keep the file store")


class MlflowTracker:
    def __init__(self, run_dir: Path, config: dict, project: str, uri: str) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri, default = tracking_uri(uri, run_dir)
        _check_store(uri)
        try:
            self.client = client = MlflowClient(tracking_uri=uri)
            exp = client.get_experiment_by_name(project)
        except Exception as e:
            if _is_file_store(uri) and "maintenance" in str(e):
                raise RuntimeError(FILE_STORE_FIX.format(uri=uri)) from e
            raise
        artifacts = (run_dir / "mlartifacts").resolve().as_uri() if default else None  # not the working directory
        exp_id = exp.experiment_id if exp is not None else client.create_experiment(project, artifacts)
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
