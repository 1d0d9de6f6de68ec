"""Weights & Biases: offline by default (run files in ``<run>/wandb/``, ``wandb sync`` uploads
them later), online with ``metrics.wandb.mode: online``. Imported only when chosen."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from engine.config import WandbConfig
from engine.metrics.logger import numbers
from engine.run_dir import MetricsDestination


class WandbBackend:
    def __init__(self, settings: WandbConfig, run_dir: Path, run_id: str, config: dict[str, Any]):
        root = Path(run_dir) / "wandb"
        root.mkdir(exist_ok=True)
        # The mode as configured, whatever the environment says; wandb's caches beside its run
        # files unless the user pointed them elsewhere.
        os.environ["WANDB_MODE"] = settings.mode
        os.environ.setdefault("WANDB_CACHE_DIR", str(root / ".cache"))
        os.environ.setdefault("WANDB_DATA_DIR", str(root / ".data"))
        import wandb

        self.run = wandb.init(
            project=settings.project,
            entity=settings.entity,
            name=settings.run_name or run_id,
            group=settings.group,
            tags=settings.tags or None,
            config=config,
            dir=str(run_dir),
            mode=settings.mode,
            settings=wandb.Settings(console="off", save_code=False, disable_git=True, x_disable_stats=True),
        )
        if settings.mode == "offline":
            sync_dir = str(self.run.settings.sync_dir)
            self.destination = MetricsDestination(
                kind="wandb", location=sync_dir, run=f"{settings.project}/{self.run.id}",
                view=f"wandb sync {sync_dir}",
            )
        else:
            self.destination = MetricsDestination(
                kind="wandb", location=str(self.run.url), run=f"{self.run.entity}/{settings.project}/{self.run.id}",
            )

    def log(self, record: dict[str, Any]) -> None:
        values = numbers(record)
        if values:
            self.run.log(values, step=int(record.get("step", 0)))

    def close(self, failed: bool = False) -> None:
        self.run.finish(exit_code=1 if failed else 0)
