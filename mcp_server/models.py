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
    checkpoints: list[CheckpointInfo] = Field(description="Oldest first (the newest 100 at most).")
    truncated: bool = Field(False, description="True when older checkpoints were left out.")


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
    checkpoints: list[CheckpointInfo] = Field(
        [], description="The newest complete checkpoints (at most 20; list_checkpoints has all)."
    )
    console_tail: str | None = Field(
        None, description="The last lines of console.log when the run failed (bounded)."
    )
    warnings: list[str] = []
    network_isolated: bool | None = Field(
        None,
        description="True: the run has no network (its own namespace, loopback only). False: it "
        "shares the host's network (see network_note). None: not known yet.",
    )
    network_note: str | None = Field(None, description="How the run's network was set up, or why it could not be isolated.")
    isolation: str | None = Field(
        None,
        description="full: a bubblewrap sandbox (own user, PID and network namespaces, no "
        "capabilities, only the recipe, data, run directory and Python mounted). partial: some "
        "of it (see isolation_note). none: only an allow-listed environment. None: not known yet.",
    )
    isolation_note: str | None = Field(None, description="What the run's isolation has, and what it is missing.")
    limits: dict[str, Any] | None = Field(
        None, description="The limits the run was started with (.trainwright/config.yaml, runs: section)."
    )


class MetricsTail(BaseModel):
    run_id: str
    status: str
    records: list[dict[str, Any]]
    truncated: bool = Field(description="True when more records matched than were returned.")


# ---------------------------------------------------------------------------------------------
# Skills and recipes
# ---------------------------------------------------------------------------------------------


class SkillSummary(BaseModel):
    name: str
    description: str
    version: str
    requires_gpu: bool


class SkillList(BaseModel):
    skills: list[SkillSummary]


class SkillDetail(SkillSummary):
    skill_md: str = Field(description="The SKILL.md text: what it does, parameters, validation, by hand.")
    params_schema: dict[str, Any] = Field(description="JSON schema of the skill's parameters.")
    truncated: bool = Field(False, description="True when skill_md was cut to fit.")


class ApplySkillResult(BaseModel):
    skill: str
    version: str
    recipe: str = Field(description="The file the skill changed (or would change), relative to the workspace.")
    changed: bool
    already_applied: bool = Field(description="The pattern was already there: nothing to do, not an error.")
    dry_run: bool
    params: dict[str, Any] = Field(description="The parameters used, with defaults filled in.")
    diff: str = Field(description="Unified diff, relative to the repository root (git apply accepts it).")
    diff_truncated: bool = False
    commit: str | None = Field(None, description="The commit that holds the change (none for dry runs).")
    message: str = ""


class TemplateInfo(BaseModel):
    name: str
    description: str


class TemplateList(BaseModel):
    templates: list[TemplateInfo]


class AppliedSkill(BaseModel):
    skill: str
    changed: bool
    commit: str | None


class ScaffoldResult(BaseModel):
    path: str = Field(description="The new recipe folder, relative to the workspace.")
    commit: str = Field(description="The commit that added the recipe.")
    config: dict[str, Any] = Field(description="The config values written to config.yaml.")
    skills: list[AppliedSkill] = Field(description="Skills applied after scaffolding, each its own commit.")


# ---------------------------------------------------------------------------------------------
# Review
# ---------------------------------------------------------------------------------------------


class ReviewRun(BaseModel):
    run_id: str
    status: str
    step: int | None = None
    loss: float | None = None
    tokens_per_s: float | None = None


class ReviewCommit(BaseModel):
    sha: str
    subject: str
    tool: str
    skill: str | None = None
    params: str | None = None
    files_changed: int
    insertions: int
    deletions: int
    runs: list[ReviewRun]
    note: str | None = None


class ReviewResult(BaseModel):
    base: str | None
    commits: list[ReviewCommit]
