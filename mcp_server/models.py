"""Results of the operations: pydantic models, so MCP clients get an output schema and
structured content, and the CLI prints the same objects with ``--json``."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field


class ResumedFrom(BaseModel):
    run_id: str
    step: int
    path: str = Field(description="The checkpoint folder, relative to the workspace.")


class LaunchRunResult(BaseModel):
    run_id: str
    status: str = Field(description="starting | running | completed | failed | stopped")
    run_dir: str = Field(description="The run directory, relative to the workspace.")
    resumed_from: ResumedFrom | None = None


class CheckpointInfo(BaseModel):
    step: int
    path: str = Field(description="Relative to the workspace.")


class CheckpointList(BaseModel):
    run_id: str
    checkpoints: list[CheckpointInfo]


class RunSummary(BaseModel):
    run_id: str
    status: str
    recipe: str
    created_at: str | None = None
    step: int | None = Field(None, description="Latest logged step.")
    max_steps: int | None = None
    loss: float | None = Field(None, description="Latest logged loss.")


class RunList(BaseModel):
    runs: list[RunSummary]
    truncated: bool = Field(False, description="True when older runs were left out.")


class RunInfo(BaseModel):
    run_id: str
    status: str = Field(description="starting | running | completed | failed | stopped")
    recipe: str
    run_dir: str
    git_commit: str | None = None
    nproc: int | None = None
    world_size: int | None = None
    created_at: str | None = None
    started_at: str | None = None
    ended_at: str | None = None
    exit_code: int | None = None
    error: str | None = Field(None, description="Why the run failed or stopped, when it did.")
    resumed_from: ResumedFrom | None = None
    step: int | None = None
    max_steps: int | None = None
    eta_s: float | None = Field(None, description="Estimated seconds left, from the latest record.")
    latest: dict[str, Any] | None = Field(None, description="The latest metrics record.")
    checkpoints: list[CheckpointInfo] = []
    console_tail: str | None = Field(
        None, description="The last lines of console.log when the run failed (bounded)."
    )
    warnings: list[str] = []


class MetricsTail(BaseModel):
    run_id: str
    status: str
    records: list[dict[str, Any]]
    truncated: bool = Field(description="True when more records matched than were returned.")
