"""Results of the operations: pydantic models, so MCP clients get an output schema and
structured content, and the CLI prints the same objects with ``--json``."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from engine import run_dir as rd
from engine.run_dir import HubModel, ResumedFrom, RunStatus
from engine.seams import ConfigField


class Result(BaseModel):
    # Built at first use, not at import: the server lists its tools from cached schemas
    # (mcp_server.schema_cache) without validating a result. A comment, not a docstring: the
    # output schemas carry docstrings.

    model_config = ConfigDict(defer_build=True)


def hub_model_shown(model: HubModel) -> str:
    """A model by Hub id as results show it: ``org/name@<commit>`` (``datasets/org/name@<commit>``)."""
    return f"{'datasets/' if model.repo_type == 'dataset' else ''}{model.repo_id}@{model.commit}"


class ResumePoint(Result):
    run_id: str
    step: int = Field(description="It continues after this step.")


class LaunchRunResult(Result):
    run_id: str
    status: RunStatus
    run_dir: str
    code: str
    config_changes: dict[str, Any]
    data: dict[str, Any] | None
    resumed_from: ResumedFrom | None = None
    warnings: list[str] = []
    nodes: str | None = None
    slurm_script: str | None = None


class CheckpointInfo(Result):
    step: int
    path: str  # relative to the workspace


class CheckpointList(Result):
    run_id: str
    checkpoints: list[CheckpointInfo] = Field(description="Oldest first (the newest 100).")
    truncated: bool = Field(False, description="Older ones left out.")
    unusable: list[str] = Field([], description="Not complete, and why.")


class RunSummary(Result):
    run_id: str
    status: str
    recipe: str
    created_at: str | None = None
    step: int | None = None  # the latest logged
    max_steps: int | None = None
    loss: float | None = None  # the latest logged
    mean_tokens_per_s: float | None = None
    last_window_tokens_per_s: float | None = None


class RunList(Result):
    runs: list[RunSummary]
    truncated: bool = Field(False, description="Older ones left out.")


def _without_the_records_descriptions(schema: dict[str, Any]) -> None:
    # The descriptions of RunFacts' fields document run.json; get_run's output schema is sent in
    # every session's tools/list (at most 20 KB in all), so it goes without them.
    for name in rd.RunFacts.model_fields:
        schema.get("properties", {}).get(name, {}).pop("description", None)


class RunInfo(rd.RunFacts):
    # The fields of RunFacts as the run's record holds them (status: the effective one; error,
    # overrides, config_changes and warnings bounded; resumed_from's path relative to the
    # workspace), and what get_run adds. A comment, not a docstring: a docstring would be the
    # output schema's description, which every tools/list carries.

    model_config = ConfigDict(json_schema_extra=_without_the_records_descriptions)

    run_id: str
    run_dir: str
    code: str
    data: dict[str, Any] | None = None
    step: int | None = None
    max_steps: int | None = None
    eta_s: float | None = None
    latest: dict[str, Any] | None = None
    speed: str | None = None
    checkpoints: list[CheckpointInfo] = []
    metrics_destinations: list[str] = []
    console_tail: str | None = None
    nodes: str | None = None
    hub_models: list[str] = []  # org/name@<commit>

    @classmethod
    def of(cls, record: rd.RunFacts, **shown: Any) -> RunInfo:
        """What get_run shows of ``record``: its :class:`~engine.run_dir.RunFacts` as recorded,
        unless ``shown`` gives them as shown, and the fields get_run adds."""
        return cls(**{**{name: getattr(record, name) for name in rd.RunFacts.model_fields}, **shown})


class DataCacheResult(Result):
    folder: str
    stores: dict[str, int]  # name -> bytes, the largest MAX_LIST_STORES
    not_listed: int = 0  # stores beyond those
    total_bytes: int = 0  # of every store
    removed: dict[str, int] = {}
    start_models: dict[str, int] = {}  # start-models/NAME -> bytes: the checkpoints launches start from, exported


class StopRunResult(Result):
    run_id: str
    status: str
    step: int | None = None
    error: str | None = None
    checkpoints: list[int] = Field([], description="Resumable steps.")


class MetricsTail(Result):
    run_id: str
    status: str
    records: list[dict[str, Any]]
    truncated: bool  # more matched than n: tail_metrics' description says it
    resumes: list[ResumePoint] = Field([], description="Where each run took over.")


# ---------------------------------------------------------------------------------------------
# Skills and recipes
# ---------------------------------------------------------------------------------------------


class SkillSummary(Result):
    name: str
    description: str
    version: str
    requires_gpu: bool


class SkillList(Result):
    skills: list[SkillSummary]


class SkillDetail(SkillSummary):
    skill_md: str
    params_schema: dict[str, Any]  # the JSON schema of its parameters
    truncated: bool = Field(False, description="Cut; skill://<name> has all.")


class ApplySkillResult(Result):
    skill: str
    version: str
    recipe: str  # the file changed
    changed: bool
    already_applied: bool  # the skill was there: nothing changed
    dry_run: bool
    params: dict[str, Any] = Field(description="With defaults.")
    diff: str = Field(description="Unified diff (git apply).")
    diff_truncated: bool = False
    commit: str | None = Field(None, description="None for dry runs.")
    message: str = ""
    acts_on: str = ""  # what the change acts on (the name says it: no description in the schema)


class TemplateInfo(Result):
    name: str
    description: str


class TemplateList(Result):
    templates: list[TemplateInfo]


class AppliedSkill(Result):
    skill: str
    changed: bool
    commit: str | None


class ScaffoldResult(Result):
    path: str  # the new recipe folder
    commit: str
    config: dict[str, Any] = Field(description="Written to config.yaml.")
    skills: list[AppliedSkill] = Field(description="Each its own commit.")


# ---------------------------------------------------------------------------------------------
# Review
# ---------------------------------------------------------------------------------------------


class ReviewRun(Result):
    run_id: str
    status: str
    step: int | None = None
    loss: float | None = None
    mean_tokens_per_s: float | None = Field(None, description="Mean over the steps after the warm-up (see speed).")
    last_window_tokens_per_s: float | None = Field(None, description="The last logging window's.")
    speed: str | None = Field(None, description="Both, with the steps measured and the warm-up left out.")
    code: str = Field("", description="The code the run executed.")
    overrides: dict[str, Any] = {}
    data: str | None = Field(None, description="What the run trained on.")


class ReviewCommit(Result):
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


class ReviewResult(Result):
    base: str | None
    commits: list[ReviewCommit]


class RecipeSkill(Result):
    skill: str
    params: str | None = Field(None, description="JSON.")
    commit: str


class RecipeDescription(Result):
    recipe: str
    template: str | None = None  # the template it was scaffolded from
    last_commit: str | None = None
    skills: list[RecipeSkill] = Field(description="Applied, oldest first.")
    fields: list[ConfigField]
    cut: str | None = None  # what was cut to fit the agent budget, and how to read it whole
    hub_models: list[str] = []  # org/name@<commit>


class RecipeSummary(Result):
    path: str
    template: str | None = None
    last_commit: str | None = None
    last_change: str | None = Field(None, description="Subject of the last commit.")
    skills: int = Field(description="Skills applied.")
    runs: int


class RecipeList(Result):
    recipes: list[RecipeSummary]
    truncated: bool = False


class WaitRunResult(Result):
    run_id: str
    reason: Literal["reached_step", "ended", "timeout"]
    status: str
    step: int | None = None
    max_steps: int | None = None
    waited_s: float
    latest: dict[str, Any] | None = None  # the latest metrics record
    error: str | None = None


# ---------------------------------------------------------------------------------------------
# Models out, and questions to them
# ---------------------------------------------------------------------------------------------


class ExportResult(Result):
    run_id: str
    step: int
    path: str
    lora: str | None = None
    tokenizer: str | None = None
    parameters: int
    files: dict[str, int]  # name: bytes


class Sample(Result):
    prompt: str
    completion: str
    new_tokens: int
    stopped: str = Field(description="eos or max_new_tokens.")
    cut: bool = False
    input: str | None = None  # what the recipe showed beside the prompt (an image's name)
    expected: str | None = None  # the answer the held-out data holds
    raw: dict[str, Any] = {}  # a chat model's completion as written (text) and parsed (reasoning, tool_calls)


class SampleResult(Result):
    run_id: str
    step: int
    chat: bool = Field(description="Prompts as user turns")
    samples: list[Sample]


class EvaluateResult(Result):
    """Counts as launch_run's."""

    run_id: str
    step: int
    eval_loss: float | None
    perplexity: float | None = None
    split: str = "held_out"
    examples: int | None = None
    tokens: int | None = None
    loss_tokens: int | None = None
    scored_tokens: int = 0
    metrics: dict[str, float]
    # lm-eval's scores (split "tasks"): {task: {"examples": n, "metrics": {...}, "stderr": {...}}}, as
    # engine.seams.TaskScore holds them; a plain mapping in the schema (tools/list's 20 KB budget).
    tasks: dict[str, Any] = {}
    warnings: list[str] = []


Verdict = Literal["better", "worse", "no difference", "not compared"]


class MetricVerdict(Result):
    metric: str
    verdict: Verdict  # b against a
    a: float | None = None
    b: float | None = None
    ratio: float | None = Field(None, description="b/a.")
    evidence: str


class CompareResult(Result):
    run_a: str
    run_b: str
    differences: list[str]
    metrics: list[MetricVerdict]
    left_out: list[str]


class AbRun(Result):
    round: int
    side: Literal["a", "b"]  # a: the commit before the skill's; b: the skill's commit
    run_id: str
    status: str


class AbRound(Result):
    round: int
    run_a: str
    run_b: str
    metrics: list[MetricVerdict]  # this round's pair alone (compare_runs)


class AbResult(Result):
    """``trainwright ab``: a skill's effect, its commit (b) against the commit before it (a), or
    two revisions of a recipe or script."""

    skill: str | None  # name@version, from the commit's Skill-Applied trailer; None: two revisions given
    recipe: str  # the recipe folder or script
    commit_a: str
    commit_b: str
    steps: int | None  # a recipe's train.max_steps; None for a script (its args say)
    args: list[str] | None = None  # a script's command line, the same for every run
    rounds: int
    command: str
    runs: list[AbRun]  # in launch order
    per_round: list[AbRound]
    differences: list[str]
    verdict: list[MetricVerdict]  # over every round: compare_groups
    left_out: list[str]
    remarks: list[str]
    outcome: Literal["completed", "failed", "stopped"]
    error: str | None = None
    note_written: bool = False


class EstimateChange(Result):
    change: str = Field(max_length=200)
    peak_gib: float
    fits: bool


class EstimateFigures(Result):
    """The engine's estimate as the launch check prints it (engine/estimate.py): read as untrusted
    output of a process that imported the recipe, so every field is typed and bounded."""

    model_config = ConfigDict(extra="forbid")

    params: int
    trainable: int
    quantized: int = 0  # values held in 4 bits (the qlora skill)
    optimizer: str = Field("AdamW", max_length=80)  # as the recipe's prepare_optimizer builds it
    checkpointed_blocks: str = Field(max_length=40)
    memory_gib: dict[Literal["floor", "params", "grads", "optimizer", "activations", "gathered", "peak_gib"], float]
    activations_source: str = Field(max_length=300)
    flops_per_token: float | None
    step_time_s: float | None
    time_source: str = Field(max_length=300)
    fits: bool | None
    changes: list[EstimateChange] = Field(max_length=20)


class EstimateResult(Result):  # per process, memory in GiB

    fits: bool | None  # None: no device memory was given
    estimate: dict[str, Any]
    changes: list[dict[str, Any]]  # when it does not fit: EstimateChange, each estimated again
