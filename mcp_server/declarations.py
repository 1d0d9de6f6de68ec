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
from typing import Annotated, Any, Awaitable, Callable, Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.seams import MAX_NEW_TOKENS, MAX_PROMPTS
from mcp_server.run_view import TOOL_META as RUN_VIEW
from mcp_server.limits import DEFAULT_TAIL_RECORDS, DEFAULT_WAIT_S, MAX_DESCRIBE_THREADS, MAX_TAIL_RECORDS, MAX_WAIT_S
from mcp_server.models import (
    ApplySkillResult,
    CheckpointList,
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

MAX_LIST_RUNS = 100



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
# How a field is spelled on the command line
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Option:
    """One command-line option for a key of an object argument (``rdzv.endpoint`` is
    ``--rdzv-endpoint``)."""

    flag: str
    help: str
    type: type = str
    metavar: str | None = None


@dataclass(frozen=True)
class Cli:
    """Where the terminal spells a field otherwise than by its name. Without one, a required
    field is a positional argument and an optional one ``--the-name``.

    ``flag``: the option's name (``--set``); ``repeat``: given once per item (a list, or with
    ``key_values`` a mapping written ``KEY=VALUE``, read by :func:`engine.config.overrides_to_dict`);
    ``more``: what the terminal's help says beyond the description; ``keys``: an object written as
    one option per key; ``after_dashes``: the command line after ``--``; ``group``: the help
    section."""

    flag: str | None = None
    metavar: str | None = None
    more: str = ""
    repeat: bool = False
    key_values: bool = False
    keys: dict[str, Option] | None = None
    after_dashes: bool = False
    group: str | None = None


class ToolArgs(BaseModel):
    """A tool's arguments, as both faces validate them."""

    model_config = ConfigDict(extra="forbid")


RunId = Annotated[str, Field(), Cli(more="A run id (`trainwright runs` lists them).")]
RecipePath = Annotated[str, Field(description="recipes/<name>, or the name.")]
Step = Annotated[int | None, Field(strict=True, description="Default: latest."),
                 Cli(metavar="N", more="The checkpoint's step.")]
KeyValues = Cli(flag="--set", metavar="KEY=VALUE", repeat=True, key_values=True,
                more="Repeatable: --set train.max_steps=50.")


# ---------------------------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------------------------


class NoArgs(ToolArgs):
    pass


class GetSkillArgs(ToolArgs):
    skill: Annotated[str, Field(description="A skill name from list_skills.")]


class ApplySkillArgs(ToolArgs):
    skill: Annotated[str, Field(description="A skill name from list_skills.")]
    recipe: Annotated[str, Field(description="recipes/<name>, the name, or a .py script.")]
    params: Annotated[dict[str, Any] | None, Field(description="Skill parameters (see get_skill)."),
                      Cli(flag="--param", metavar="KEY=VALUE", repeat=True, key_values=True)] = None
    dry_run: Annotated[bool, Field(strict=True, description="Only return the diff; change nothing.")] = False
    target: Annotated[str | None, Field(description="The model to act on: self._model, file.py:LINE."),
                      Cli(metavar="EXPR", more="A refusal lists the candidates it saw.")] = None


class ScaffoldArgs(ToolArgs):
    template: Annotated[str, Field(description="A template name from list_templates.")]
    name: Annotated[str, Field(description="The new recipes/<name>/.")]
    config: Annotated[dict[str, Any] | None, Field(description='Dotted keys: {"train.max_steps": 500}.'),
                      Cli(flag="--config", metavar="KEY=VALUE", repeat=True, key_values=True,
                          more="Written to config.yaml; repeatable.")] = None
    skills: Annotated[list[str | dict[str, Any]] | None, Field(description="Names, or {name, params}."),
                      Cli(flag="--skill", metavar="SKILL", repeat=True,
                          more="Each applied after scaffolding, as its own commit.")] = None


class RecipeArgs(ToolArgs):
    recipe: RecipePath


class DescribeArgs(RecipeArgs):
    keys: Annotated[list[str], Field(description="Only these keys or sections, described whole."),
                    Cli(flag="--key", metavar="KEY", repeat=True, more="A dotted key or its start (train); repeatable.")] = []


class LaunchRunArgs(ToolArgs):
    recipe: Annotated[str, Field(description="Recipe folder, or a .py script."),
                      Cli(more="A training script is a .py file or a folder with a train.py, relative to the "
                          "workspace; its own command line follows -- at the end.")]
    nproc: Annotated[int, Field(strict=True, description="Processes per node.")] = 1
    overrides: Annotated[dict[str, Any] | None, Field(description='Config: {"train.max_steps": 100}.'),
                         KeyValues] = None
    nnodes: Annotated[int, Field(strict=True, description="Nodes."),
                      Cli(group="several nodes (docs/scaling.md)", more="--nproc processes on each.")] = 1
    rdzv: Annotated[dict[str, Any], Field(description="nnodes>1: endpoint host:port, id, node_rank."),
                    Cli(group="several nodes (docs/scaling.md)", keys={
                        "endpoint": Option("--rdzv-endpoint", "c10d rendezvous on the first node, reachable "
                                           "from every node (nnodes > 1)", metavar="HOST:PORT"),
                        "id": Option("--rdzv-id", "rendezvous id (default: node 0's run id; required with "
                                     "--node-rank > 0: node 0's run id)", metavar="ID"),
                        "node_rank": Option("--node-rank", "0 starts the run (default), others join it",
                                            int, "N")})] = {}
    target: Annotated[Literal["local", "slurm"], Field(description="slurm: sbatch job."),
                      Cli(group="several nodes (docs/scaling.md)",
                          more="local: start here; slurm: write runs/<id>/job.sbatch and submit it.")] = "local"
    slurm: Annotated[dict[str, Any], Field(description="partition, time, gpus_per_node."),
                     Cli(group="several nodes (docs/scaling.md)", keys={
                         "partition": Option("--partition", "with --target slurm: the partition"),
                         "time": Option("--time", "with --target slurm: the time limit (default 01:00:00)"),
                         "gpus_per_node": Option("--gpus-per-node", "with --target slurm: GPUs per node "
                                                 "(default: --nproc)", int, "N"),
                         "rdzv_port": Option("--rdzv-port", "with --target slurm: the rendezvous port on the "
                                             "job's first node (default 29400)", int, "PORT")})] = {}
    args: Annotated[list[str], Field(description="Script's command line."), Cli(after_dashes=True)] = []
    resume_arg: Annotated[str, Field(description="Script option for a checkpoint path."),
                          Cli(metavar="OPTION", more="Given with = (--resume-arg=--resume): `trainwright "
                              "resume` passes the checkpoint with it.")] = ""
    commit: Annotated[str, Field(description="Run this commit's code (sha, sha^)."),
                      Cli(metavar="REV", more="Not the folder as it is now.")] = ""


class EstimateArgs(ToolArgs):
    recipe: RecipePath
    overrides: Annotated[dict[str, Any] | None, Field(description="As launch_run's."), KeyValues] = None
    nproc: Annotated[int, Field(strict=True, description="Processes.")] = 1
    device: Annotated[Literal["cpu", "cuda"], Field(description="Device class.")] = "cpu"
    device_memory_gib: Annotated[float | None, Field(description="Per process: does it fit?"),
                                 Cli(metavar="GIB", more="The memory of one device.")] = None


class ListRunsArgs(ToolArgs):
    limit: Annotated[int, Field(strict=True, description=f"1-{MAX_LIST_RUNS}.")] = 20


class RunArgs(ToolArgs):
    run_id: RunId


class WaitRunArgs(ToolArgs):
    run_id: RunId
    until_step: Annotated[int | None, Field(strict=True, description="Return once it is logged; default: the end."),
                          Cli(metavar="N")] = None
    timeout_s: Annotated[float, Field(strict=True, description=f"At most {MAX_WAIT_S}."),
                         Cli(flag="--timeout", metavar="S", more="Exit 124 when it passes first.")] = DEFAULT_WAIT_S


class TailArgs(ToolArgs):
    run_id: RunId
    n: Annotated[int, Field(strict=True, description=f"1-{MAX_TAIL_RECORDS}."), Cli(flag="-n")] = DEFAULT_TAIL_RECORDS
    after_step: Annotated[int | None, Field(strict=True, description="Only records after this step."),
                          Cli(metavar="N")] = None
    follow_resumes: Annotated[bool, Field(strict=True, description="Also the runs it was resumed from.")] = False


class CompareArgs(ToolArgs):
    run_a: RunId
    run_b: RunId


class ResumeArgs(ToolArgs):
    run_id: RunId
    step: Step = None
    nproc: Annotated[int | None, Field(strict=True, description="Default: as the run.")] = None
    code: Annotated[Literal["checkpoint", "head"],
                    Field(description="checkpoint: the run's code; head: the recipe now.")] = "checkpoint"
    overrides: Annotated[dict[str, Any] | None, Field(description='e.g. {"train.max_steps": 400}'), KeyValues] = None


class ExportArgs(ToolArgs):
    run_id: RunId
    to: Annotated[str, Field(description="A new or empty folder in the workspace."), Cli(flag="--to", metavar="DIR")]
    step: Step = None
    lora: Annotated[Literal["merged", "adapter"], Field(description="LoRA runs: merged weights or a peft adapter.")] = "merged"


class SampleArgs(ToolArgs):
    run_id: RunId
    prompts: Annotated[list[str], Field(description=f"At most {MAX_PROMPTS} texts."),
                       Cli(flag="--prompt", metavar="TEXT", repeat=True, more="Repeatable.")]
    step: Step = None
    max_new_tokens: Annotated[int, Field(strict=True, description=f"1-{MAX_NEW_TOKENS}.")] = 64
    temperature: Annotated[float, Field(strict=True, description="0: greedy.")] = 0.0


class EvaluateArgs(ToolArgs):
    run_id: RunId
    step: Step = None
    data: Annotated[list[str] | None, Field(description="Files; default: the held-out split."),
                    Cli(metavar="PATH", repeat=True, more="Files or folders; repeatable.")] = None


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


def _list_checkpoints(ws: Any, a: RunArgs, report: Report) -> CheckpointList:
    from mcp_server.operations import runs

    return runs.list_checkpoints(ws, a.run_id)


def _resume_checkpoint(ws: Any, a: ResumeArgs, report: Report) -> LaunchRunResult:
    from mcp_server.operations import launch

    return launch.resume_checkpoint(ws, a.run_id, a.step, a.nproc, overrides=a.overrides, code=a.code,
                                    progress=report.download)


def _export_checkpoint(ws: Any, a: ExportArgs, report: Report) -> ExportResult:
    from mcp_server.operations import model_tools

    return model_tools.export_checkpoint(ws, a.run_id, a.to, a.step, a.lora)


def _sample(ws: Any, a: SampleArgs, report: Report) -> SampleResult:
    from mcp_server.operations import model_tools

    return model_tools.sample(ws, a.run_id, a.prompts, a.step, a.max_new_tokens, a.temperature)


def _evaluate(ws: Any, a: EvaluateArgs, report: Report) -> EvaluateResult:
    from mcp_server.operations import model_tools

    return model_tools.evaluate(ws, a.run_id, a.step, a.data)


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
    ToolSpec("list_skills", "The skills apply_skill can write; get_skill explains one.",
             ("skills", "list"), "list the skills", NoArgs, SkillList, READ_ONLY, _list_skills, workspace=False),
    ToolSpec("get_skill", "A skill's SKILL.md and parameter schema.",
             ("skills", "show"), "print a skill's SKILL.md", GetSkillArgs, SkillDetail, READ_ONLY, _get_skill,
             workspace=False),
    ToolSpec("apply_skill", "Write a skill's pattern into a recipe's code as one git commit; a refusal says "
             "what works.",  # idempotent: the annotation says it, the description need not
             ("apply",), "apply a skill to a recipe folder or script, as one commit", ApplySkillArgs,
             ApplySkillResult, IDEMPOTENT_CHANGE, _apply_skill),
    # Recipes
    ToolSpec("list_templates", "The templates scaffold_recipe can copy.",
             ("templates",), "list recipe templates", NoArgs, TemplateList, READ_ONLY, _list_templates,
             workspace=False),
    ToolSpec("scaffold_recipe", "Create recipes/<name>/ from a template as a commit (one more per skill); a bad "
             "key or skill writes nothing.",
             ("scaffold",), "create recipes/NAME from a template, as a commit", ScaffoldArgs, ScaffoldResult,
             ADDITIVE_HUB, _scaffold_recipe, stages=Stages("checking the config and skills", "scaffolded", 2)),
    ToolSpec("describe_recipe", "Every config key of a recipe or template, skills applied, Hub models.",
             ("describe",), "every config key of a recipe, its template and skills", DescribeArgs,
             RecipeDescription, READ_ONLY_HUB, _describe_recipe, threads=MAX_DESCRIBE_THREADS),
    ToolSpec("list_recipes", "The workspace's recipes: template, last commit, skills, runs.",
             ("recipes",), "list the workspace's recipes: template, last commit, skills, runs", NoArgs, RecipeList,
             READ_ONLY, _list_recipes),
    # Runs
    ToolSpec("launch_run", "Run a snapshot of a recipe or .py script (JSON lines with a step: metrics); returns "
             "run_id at once, or writes nothing on error.",
             ("run",), "launch a training run of a recipe folder or of a Python script", LaunchRunArgs,
             LaunchRunResult, ADDITIVE_HUB, _launch_run,
             stages=Stages("checking the recipe and config", "started {run_id}", 2), announce=_launched),
    ToolSpec("estimate_run", "Memory and step time per process before launch_run; over device_memory_gib, "
             "changes that fit.",
             ("estimate",), "memory and step time per process before a run, from the model on the meta device",
             EstimateArgs, EstimateResult, READ_ONLY_HUB, _estimate_run),
    ToolSpec("list_runs", "The workspace's runs, newest first: status, step, loss, mean tokens/s.",
             ("runs",), "list runs, newest first", ListRunsArgs, RunList, READ_ONLY, _list_runs),
    ToolSpec("get_run", "A run's status, metrics, speed, ETA, checkpoints; a failed run's console end.",
             ("status",), "status, latest metrics and checkpoints of a run", RunArgs, RunInfo, READ_ONLY, _get_run,
             meta=RUN_VIEW),
    ToolSpec("wait_run", "Wait until a run logs until_step, ends, or timeout_s passes (reason).",
             ("wait",), "wait until a run reaches a step or ends; exit 124 on timeout", WaitRunArgs, WaitRunResult,
             READ_ONLY, _wait_run, meta=RUN_VIEW, task=True, announce=_ended),
    ToolSpec("tail_metrics", "The latest metrics records of a run.",
             ("tail",), "the latest metrics records of a run", TailArgs, MetricsTail, READ_ONLY, _tail_metrics),
    ToolSpec("compare_runs", "b vs a: config and code differences, loss at equal tokens, speed, memory, judged "
             "at the runs' noise.",
             ("compare",), "b against a: config and code differences, then a verdict per metric at the noise of "
             "their windows", CompareArgs, CompareResult, READ_ONLY, _compare_runs),
    ToolSpec("stop_run", "Stop a run and all its processes; checkpoints stay.",
             ("stop",), "stop a run and all its processes", RunArgs, StopRunResult, DESTRUCTIVE, _stop_run),
    ToolSpec("list_checkpoints", "A run's complete checkpoints.",
             ("checkpoints",), "complete checkpoints of a run", RunArgs, CheckpointList, READ_ONLY,
             _list_checkpoints),
    ToolSpec("resume_checkpoint", "Continue a run from a checkpoint as a new run (its config + overrides).",
             ("resume",), "continue a run from its checkpoint as a new run", ResumeArgs, LaunchRunResult,
             ADDITIVE_HUB, _resume_checkpoint, announce=_resumed),
    # Models: export, sample, evaluate (each loads the recipe in the run sandbox)
    ToolSpec("export_checkpoint", "Write a checkpoint as a Hugging Face folder (weights, config, tokenizer).",
             ("export",), "write a checkpoint as a Hugging Face model folder", ExportArgs, ExportResult, ADDITIVE,
             _export_checkpoint, stages=IN_SANDBOX, task=True),
    ToolSpec("sample", "Continue prompts with a checkpoint's model.",
             ("sample",), "continue prompts with a checkpoint's model", SampleArgs, SampleResult, READ_ONLY, _sample,
             stages=IN_SANDBOX),
    ToolSpec("evaluate", "A checkpoint's eval loss and the recipe's task metrics.",
             ("evaluate",), "eval loss and task metrics of a checkpoint", EvaluateArgs, EvaluateResult, READ_ONLY,
             _evaluate, stages=IN_SANDBOX, task=True),
)

BY_NAME: dict[str, ToolSpec] = {spec.name: spec for spec in TOOLS}
TASK_TOOLS = frozenset(spec.name for spec in TOOLS if spec.task)
