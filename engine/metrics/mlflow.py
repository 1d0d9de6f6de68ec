"""MLflow: a SQLite store in ``<run>/mlflow/`` by default (``mlflow ui --backend-store-uri
sqlite:///...`` shows it), or the server of ``metrics.mlflow.tracking_uri``. Imported only when
chosen; the SQLite store needs sqlalchemy and alembic besides mlflow-skinny."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from engine.config import MlflowConfig
from engine.metrics.logger import numbers
from engine.run_dir import MetricsDestination

MAX_PARAMS_PER_BATCH = 100  # MLflow's limit per log_batch call
MAX_PARAM_CHARS = 6000


def local_tracking_uri(run_dir: Path) -> str:
    return f"sqlite:///{(Path(run_dir) / 'mlflow' / 'mlflow.db').resolve()}"


class MlflowBackend:
    def __init__(self, settings: MlflowConfig, run_dir: Path, run_id: str, params: dict[str, Any]):
        local = settings.tracking_uri is None
        uri = local_tracking_uri(run_dir) if local else settings.tracking_uri
        if local:
            (Path(run_dir) / "mlflow").mkdir(exist_ok=True)
            os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        self._metric = Metric
        self.client = MlflowClient(tracking_uri=uri)
        experiment_id = self._experiment_id(settings.experiment, Path(run_dir) / "mlflow" / "artifacts" if local else None)
        self.run_id = self.client.create_run(
            experiment_id, run_name=settings.run_name or run_id, tags={"trainwright.run_id": run_id}
        ).info.run_id
        items = [Param(key, (value if isinstance(value, str) else json.dumps(value))[:MAX_PARAM_CHARS])
                 for key, value in params.items()]
        for start in range(0, len(items), MAX_PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=items[start:start + MAX_PARAMS_PER_BATCH])
        self.destination = MetricsDestination(
            kind="mlflow", location=uri, run=f"{settings.experiment}/{self.run_id}",
            view=f"mlflow ui --backend-store-uri {uri}" if local else None,
        )

    def _experiment_id(self, name: str, artifacts: Path | None) -> str:
        from mlflow.exceptions import MlflowException

        experiment = self.client.get_experiment_by_name(name)
        if experiment is not None:
            return experiment.experiment_id
        try:
            return self.client.create_experiment(name, artifact_location=artifacts.resolve().as_uri() if artifacts else None)
        except MlflowException:  # another run created it in between (a shared server)
            experiment = self.client.get_experiment_by_name(name)
            if experiment is None:
                raise
            return experiment.experiment_id

    def log(self, record: dict[str, Any]) -> None:
        step = int(record.get("step", 0))
        now = int(time.time() * 1000)
        metrics = [self._metric(key, float(value), now, step) for key, value in numbers(record).items()]
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)

    def close(self, failed: bool = False) -> None:
        self.client.set_terminated(self.run_id, "FAILED" if failed else "FINISHED")
