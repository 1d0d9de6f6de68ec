"""trackio: a local store in ``<run>/trackio/`` by default (``TRACKIO_DIR=<that folder>
trackio show`` shows it), or a Hugging Face Space with ``metrics.trackio.space_id``. Imported
only when chosen."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from engine.config import TrackioConfig
from engine.metrics.logger import numbers
from engine.run_dir import MetricsDestination


class TrackioBackend:
    def __init__(self, settings: TrackioConfig, run_dir: Path, run_id: str, config: dict[str, Any]):
        store = (Path(run_dir) / "trackio").resolve()
        if settings.space_id is None:
            # trackio reads its folder from the environment once, when it is imported.
            os.environ["TRACKIO_DIR"] = str(store)
        import trackio

        name = settings.run_name or run_id
        self.trackio = trackio
        self.run = trackio.init(
            project=settings.project, name=name, config=config, space_id=settings.space_id,
            embed=False, auto_log_gpu=False, auto_log_cpu=False,
        )
        if settings.space_id is None:
            self.destination = MetricsDestination(
                kind="trackio", location=str(store), run=f"{settings.project}/{name}",
                view=f"TRACKIO_DIR={store} trackio show --project {settings.project}",
            )
        else:
            self.destination = MetricsDestination(
                kind="trackio", location=f"https://huggingface.co/spaces/{settings.space_id}",
                run=f"{settings.project}/{name}",
            )

    def log(self, record: dict[str, Any]) -> None:
        values = numbers(record)
        if values:
            self.run.log(values, step=int(record.get("step", 0)))

    def close(self, failed: bool = False) -> None:
        self.trackio.finish()  # also forgets the current run, so trackio's exit hook does not finish it again
