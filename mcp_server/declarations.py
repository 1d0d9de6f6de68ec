"""Every tool, declared once: its arguments (a pydantic model whose fields carry the
descriptions, defaults and limits an agent reads), its result model, its annotations, and the
operation it runs.

Both faces are generated from :data:`TOOLS`: :mod:`mcp_server.server` binds each
:class:`ToolSpec` as an MCP tool (the arguments model becomes the tool's parameters), and
:mod:`mcp_server.cli` adds it as a subcommand (a required field is a positional argument, the
others options; :class:`Cli` says where a terminal spells a field differently). A parameter
added here appears in both, with the same default; ``tests/cli/test_cli_mcp_parity.py`` fails
where they still differ.

Kept light: the CLI imports this module on every start, so the operations (which bring git and
the sandbox) are imported when a tool runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from pydantic import BaseModel

from mcp_server.arguments import (
    ApplySkillArgs,
    CompareArgs,
    DataCacheArgs,
    DescribeArgs,
    EstimateArgs,
    EvaluateArgs,
    ExportArgs,
    GetSkillArgs,
    LaunchRunArgs,
    ListRunsArgs,
    NoArgs,
    ResumeArgs,
    RunArgs,
    SampleArgs,
    ScaffoldArgs,
    TailArgs,
    ToolArgs,
    WaitRunArgs,
)
from mcp_server.run_view import TOOL_META as RUN_VIEW
from mcp_server.limits import MAX_DESCRIBE_THREADS
from mcp_server.models import (
    ApplySkillResult,
    CheckpointList,
    DataCacheResult,
    CompareResult,
    EstimateResult,
    EvaluateResult,
    ExportResult,
    LaunchRunResult,
    MetricsTail,
    RecipeDescription,
    RecipeList,
    RunInfo,
    RunList,
    SampleResult,
    ScaffoldResult,
    SkillDetail,
    SkillList,
    StopRunResult,
    TemplateList,
    WaitRunResult,
)

@dataclass(frozen=True)
class Hints:
    """What a tool changes and what it reaches: its MCP ``ToolAnnotations`` (None: a hint left
    out). idempotentHint and destructiveHint mean something only for tools that change something
    (the MCP spec), so a read-only tool says neither."""

    read_only: bool
    destructive: bool | None = None
    idempotent: bool | None = None
    open_world: bool | None = False  # None: the spec's default, open world


READ_ONLY = Hints(read_only=True)
ADDITIVE = Hints(read_only=False, destructive=False)
IDEMPOTENT_CHANGE = Hints(read_only=False, destructive=False, idempotent=True)
DESTRUCTIVE = Hints(read_only=False, destructive=True, idempotent=True)
# Tools that download a model or data set the config names by Hub id reach the Hugging Face Hub:
# open world (the spec's default, so the key is left out).
READ_ONLY_HUB = Hints(read_only=True, open_world=None)
ADDITIVE_HUB = Hints(read_only=False, destructive=False, open_world=None)


# ---------------------------------------------------------------------------------------------
# The spec
# ---------------------------------------------------------------------------------------------


@dataclass
class Report:
    """How a tool's long work tells its caller how far it got: a Hub download's bytes and a
    wait in line (each called from the worker thread the operation runs in), and a run's progress
    while waiting on it."""

    download: Callable[[float, float | None, str], None] | None = None
    observe: Callable[[Any], Awaitable[None]] | None = None
    waiting: Callable[[str], None] | None = None


@dataclass(frozen=True)
class Stages:
    """A tool's progress as the MCP caller sees it: ``start`` at 0, ``end`` (formatted with the
    result's fields) at ``total``; a download between them counts up to ``total - 1``."""

    start: str
    end: str
    total: int


@dataclass(frozen=True)
class ToolSpec:
    """One tool: its MCP name and description, its CLI command and help line, its arguments and
    result models, its hints and the operation (``run(workspace, args, report)``)."""

    name: str
    description: str
    command: tuple[str, ...]
    help: str
    args: type[ToolArgs]
    result: type[BaseModel]
    hints: Hints
    run: Callable[[Any, Any, Report], Any]
    meta: dict[str, Any] | None = None
    stages: Stages | None = None
    task: bool = False  # also runs as an MCP task (mcp_server.tasks)
    threads: int | None = None  # at most this many calls hold a worker thread (None: the server's pool)
    workspace: bool = True  # False: needs no workspace (the skill and template catalogues)
    announce: Callable[[Any, Any], tuple[str, str | None] | None] | None = None  # a client log line
    # False: a CLI command only, not served over MCP (tools/list's 20 KB has no room left for it)
    mcp: bool = True


# ---------------------------------------------------------------------------------------------
# Operations (imported when a tool runs; tests replace them on their modules)
# ---------------------------------------------------------------------------------------------


def _list_skills(ws: Any, a: NoArgs, report: Report) -> SkillList:
    from mcp_server.operations import skills

    return skills.list_skills()


def _get_skill(ws: Any, a: GetSkillArgs, report: Report) -> SkillDetail:
    from mcp_server.operations import skills

    return skills.get_skill(a.skill)


def _apply_skill(ws: Any, a: ApplySkillArgs, report: Report) -> ApplySkillResult:
    from mcp_server.operations import skills

    return skills.apply_skill(ws, a.skill, a.recipe, skills.with_target(a.params, a.target), a.dry_run)


def _list_templates(ws: Any, a: NoArgs, report: Report) -> TemplateList:
    from mcp_server.operations import recipes

    return recipes.list_templates()


def _scaffold_recipe(ws: Any, a: ScaffoldArgs, report: Report) -> ScaffoldResult:
    from mcp_server.operations import recipes

    return recipes.scaffold_recipe(ws, a.template, a.name, a.config, a.skills, progress=report.download)


def _describe_recipe(ws: Any, a: DescribeArgs, report: Report) -> RecipeDescription:
    from mcp_server.operations import recipe_info

    return recipe_info.describe_recipe(ws, a.recipe, a.keys, waiting=report.waiting)


def _list_recipes(ws: Any, a: NoArgs, report: Report) -> RecipeList:
    from mcp_server.operations import recipe_info

    return recipe_info.list_recipes(ws)


def _launch_run(ws: Any, a: LaunchRunArgs, report: Report) -> LaunchRunResult:
    from mcp_server.operations import launch

    return launch.launch_run(ws, a.recipe, a.nproc, a.overrides, nnodes=a.nnodes, rdzv=a.rdzv or None,
                             target=a.target, slurm=a.slurm or None, progress=report.download,
                             args=a.args or None, resume_arg=a.resume_arg or None, commit=a.commit or None)


def _estimate_run(ws: Any, a: EstimateArgs, report: Report) -> EstimateResult:
    from mcp_server.operations import estimate

    return estimate.estimate_run(ws, a.recipe, a.overrides, a.nproc, a.device, a.device_memory_gib)


def _list_runs(ws: Any, a: ListRunsArgs, report: Report) -> RunList:
    from mcp_server.operations import runs

    return runs.list_runs(ws, a.limit)


def _get_run(ws: Any, a: RunArgs, report: Report) -> RunInfo:
    from mcp_server.operations import runs

    return runs.get_run(ws, a.run_id)


async def _wait_run(ws: Any, a: WaitRunArgs, report: Report) -> WaitRunResult:
    from mcp_server.operations import waiting

    return await waiting.wait_run(ws, a.run_id, a.until_step, a.timeout_s, report.observe)


def _tail_metrics(ws: Any, a: TailArgs, report: Report) -> MetricsTail:
    from mcp_server.operations import runs

    return runs.tail_metrics(ws, a.run_id, a.n, a.after_step, a.follow_resumes)


def _compare_runs(ws: Any, a: CompareArgs, report: Report) -> CompareResult:
    from mcp_server.operations import compare

    return compare.compare_runs(ws, a.run_a, a.run_b)


def _stop_run(ws: Any, a: RunArgs, report: Report) -> StopRunResult:
    from mcp_server.operations import runs

    return runs.stop_run(ws, a.run_id)


def _data_cache(ws: Any, a: DataCacheArgs, report: Report) -> DataCacheResult:
    from mcp_server.operations import data_cache

    return data_cache.data_cache(ws, a.remove)


def _list_checkpoints(ws: Any, a: RunArgs, report: Report) -> CheckpointList:
    from mcp_server.operations import runs

    return runs.list_checkpoints(ws, a.run_id)


def _resume_checkpoint(ws: Any, a: ResumeArgs, report: Report) -> LaunchRunResult:
    from mcp_server.operations import launch

    return launch.resume_checkpoint(ws, a.run_id, a.step, a.nproc, overrides=a.overrides, code=a.code,
                                    progress=report.download, args=a.args)


def _export_checkpoint(ws: Any, a: ExportArgs, report: Report) -> ExportResult:
    from mcp_server.operations import model_tools

    return model_tools.export_checkpoint(ws, a.run_id, a.to, a.step, a.lora, gguf=a.gguf, private=a.private,
                                         progress=report.download)


def _sample(ws: Any, a: SampleArgs, report: Report) -> SampleResult:
    from mcp_server.operations import model_tools

    return model_tools.sample(ws, a.run_id, a.prompts, a.step, a.max_new_tokens, a.temperature, a.think, a.images or None)


def _evaluate(ws: Any, a: EvaluateArgs, report: Report) -> EvaluateResult:
    from mcp_server.operations import model_tools

    return model_tools.evaluate(ws, a.run_id, a.step, a.data, tasks=a.tasks, progress=report.download)


def _launched(a: LaunchRunArgs, r: LaunchRunResult) -> tuple[str, str | None]:
    return f"run {r.run_id} launched ({a.recipe})", None


def _resumed(a: ResumeArgs, r: LaunchRunResult) -> tuple[str, str | None]:
    return f"run {r.run_id} launched (resuming {a.run_id})", None


def _ended(a: WaitRunArgs, r: WaitRunResult) -> tuple[str, str | None] | None:
    if r.reason != "ended":
        return None
    return f"run {r.run_id} {r.status}" + (f": {r.error}" if r.error else ""), r.status


IN_SANDBOX = Stages("loading the checkpoint in the sandbox", "done", 1)

TOOLS: tuple[ToolSpec, ...] = (
    # Skills
    ToolSpec("list_skills", "Skills apply_skill writes; get_skill explains one.",
             ("skills", "list"), "list the skills", NoArgs, SkillList, READ_ONLY, _list_skills, workspace=False),
    ToolSpec("get_skill", "A skill's SKILL.md and params schema.",
             ("skills", "show"), "print a skill's SKILL.md", GetSkillArgs, SkillDetail, READ_ONLY, _get_skill,
             workspace=False),
    ToolSpec("apply_skill", "Write a skill's pattern into a recipe as one git commit.",  # idempotent: the annotation says it, the description need not
             ("apply",), "apply a skill to a recipe folder or script, as one commit", ApplySkillArgs,
             ApplySkillResult, IDEMPOTENT_CHANGE, _apply_skill),
    # Recipes
    ToolSpec("list_templates", "Templates scaffold_recipe can copy.",
             ("templates",), "list recipe templates", NoArgs, TemplateList, READ_ONLY, _list_templates,
             workspace=False),
    ToolSpec("scaffold_recipe", "Create recipes/<name>/ from a template in a commit (+1 per skill).",
             ("scaffold",), "create recipes/NAME from a template, as a commit", ScaffoldArgs, ScaffoldResult,
             ADDITIVE_HUB, _scaffold_recipe, stages=Stages("checking the config and skills", "scaffolded", 2)),
    ToolSpec("describe_recipe", "A recipe's or template's config keys, skills and Hub models.",
             ("describe",), "every config key of a recipe, its template and skills", DescribeArgs,
             RecipeDescription, READ_ONLY_HUB, _describe_recipe, threads=MAX_DESCRIBE_THREADS),
    ToolSpec("list_recipes", "Recipes: template, last commit, skills.",
             ("recipes",), "list the workspace's recipes: template, last commit, skills, runs", NoArgs, RecipeList,
             READ_ONLY, _list_recipes),
    # Runs
    ToolSpec("launch_run", "Snapshot and run a recipe or .py script (JSON lines with a step: metrics); returns "
             "run_id at once.",
             ("run",), "launch a training run of a recipe folder or of a Python script", LaunchRunArgs,
             LaunchRunResult, ADDITIVE_HUB, _launch_run,
             stages=Stages("checking the recipe and config", "started {run_id}", 2), announce=_launched),
    ToolSpec("estimate_run", "Per-process memory and step time before launch_run; over device_memory_gib: "
             "what fits.",
             ("estimate",), "memory and step time per process before a run, from the model on the meta device",
             EstimateArgs, EstimateResult, READ_ONLY_HUB, _estimate_run),
    ToolSpec("list_runs", "Runs, newest first: status, step, loss, tok/s.",
             ("runs",), "list runs, newest first", ListRunsArgs, RunList, READ_ONLY, _list_runs),
    ToolSpec("get_run", "A run's status, metrics, speed, ETA, checkpoints; a failure's console end.",
             ("status",), "status, latest metrics and checkpoints of a run", RunArgs, RunInfo, READ_ONLY, _get_run,
             meta=RUN_VIEW),
    ToolSpec("wait_run", "Wait for until_step, the run's end, or timeout_s (reason).",
             ("wait",), "wait until a run reaches a step or ends; exit 124 on timeout", WaitRunArgs, WaitRunResult,
             READ_ONLY, _wait_run, meta=RUN_VIEW, task=True, announce=_ended),
    ToolSpec("tail_metrics", "A run's latest metrics records.",
             ("tail",), "the latest metrics records of a run", TailArgs, MetricsTail, READ_ONLY, _tail_metrics),
    ToolSpec("compare_runs", "b vs a: config/code diffs, loss at equal tokens, speed, memory, judged "
             "at their noise.",
             ("compare",), "b against a: config and code differences, then a verdict per metric at the noise of "
             "their windows", CompareArgs, CompareResult, READ_ONLY, _compare_runs),
    ToolSpec("stop_run", "Stop a run and its processes; checkpoints stay.",
             ("stop",), "stop a run and all its processes", RunArgs, StopRunResult, DESTRUCTIVE, _stop_run),
    ToolSpec("list_checkpoints", "A run's complete checkpoints.",
             ("checkpoints",), "complete checkpoints of a run", RunArgs, CheckpointList, READ_ONLY,
             _list_checkpoints),
    ToolSpec("data_cache", "Tokenized data runs share: size per store; remove frees it.",
             ("data-cache",), "list the tokenized data runs share and the start-models/ exports launches start from, "
             "with sizes; --remove NAME|start-models/NAME|all frees it",
             DataCacheArgs, DataCacheResult, DESTRUCTIVE, _data_cache, mcp=False),
    ToolSpec("resume_checkpoint", "A new run from a run's checkpoint (its config + overrides).",
             ("resume",), "continue a run from its checkpoint as a new run", ResumeArgs, LaunchRunResult,
             ADDITIVE_HUB, _resume_checkpoint, announce=_resumed),
    # Models: export, sample, evaluate (each loads the recipe in the run sandbox)
    ToolSpec("export_checkpoint", "Write a checkpoint as a Hugging Face folder or GGUF file.", ("export",), "write a checkpoint as a Hugging Face model folder or a GGUF file, or push it to the Hub", ExportArgs, ExportResult,
             ADDITIVE_HUB,
             _export_checkpoint, stages=IN_SANDBOX, task=True),
    ToolSpec("sample", "Continue prompts with a checkpoint's model.",
             ("sample",), "continue prompts with a checkpoint's model", SampleArgs, SampleResult, READ_ONLY, _sample,
             stages=IN_SANDBOX),
    ToolSpec("evaluate", "A checkpoint's eval loss, task metrics or lm-eval scores.",
             ("evaluate",), "eval loss and task metrics of a checkpoint, or lm-evaluation-harness scores (--task)", EvaluateArgs, EvaluateResult, READ_ONLY,
             _evaluate, stages=IN_SANDBOX, task=True),
)

BY_NAME: dict[str, ToolSpec] = {spec.name: spec for spec in TOOLS}
TASK_TOOLS = frozenset(spec.name for spec in TOOLS if spec.task)
