"""Every tool's arguments: a pydantic model per tool whose fields carry the descriptions,
defaults and limits an agent reads, and :class:`Cli`, where a terminal spells a field otherwise
than by its name. :mod:`mcp_server.declarations` pairs each with its tool; the MCP binding and the
CLI are generated from both.

Each argument is checked here, once: its type (strict), and its bounds and choices
(:func:`must`, :func:`checked_by`: validators that add nothing to the tool's schema, so
tools/list stays within its bytes). A value a check refuses is bad input whose message names
the field (:func:`refusal`), over MCP as on the command line. An operation takes the values its
model validated and checks only what needs the workspace (names, paths, runs, recipes); a
Python caller with untrusted values validates them first, ``LaunchRunArgs.checked(...)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Any, Callable, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, ValidationInfo
from typing_extensions import Self

from engine.benchmarks import check_tasks
from engine.errors import BadInput
from engine.model_io import check_max_new_tokens, check_prompts, check_temperature
from engine.seams import GGUF_QUANTIZATIONS, MAX_DATA_PATHS, MAX_NEW_TOKENS, MAX_PROMPTS
from mcp_server.limits import (
    DEFAULT_TAIL_RECORDS,
    DEFAULT_WAIT_S,
    MAX_DEVICE_MEMORY_GIB,
    MAX_KEY_CHARS,
    MAX_KEYS_ASKED,
    MAX_LIST_RUNS,
    MAX_NPROC,
    MAX_TAIL_RECORDS,
    MAX_WAIT_S,
)


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


# ---------------------------------------------------------------------------------------------
# A field's checks beyond its type, and how a refusal reads
# ---------------------------------------------------------------------------------------------


def must(ok: Callable[[Any], bool], what: str, then: str = "") -> AfterValidator:
    """A field's bound: a value (not None) for which ``ok`` is false is bad input that reads
    ``<field> must be <what>, got <value><then>``."""

    def check(value: Any, info: ValidationInfo) -> Any:
        if value is not None and not ok(value):
            raise BadInput(f"{info.field_name} must be {what}, got {value!r}{then}")
        return value

    return AfterValidator(check)


def within(low: float, high: float, above: bool = False, size: bool = False) -> Callable[[Any], bool]:
    """``low <= value <= high`` (``above``: ``low < value``; ``size``: of ``len(value)``). The
    bounds are bound now: a field's annotation may be evaluated again elsewhere (the MCP SDK
    builds its own model of a tool's parameters), where a name looked up later is not there."""

    def ok(value: Any) -> bool:
        measured = len(value) if size else value
        return (low < measured if above else low <= measured) and measured <= high

    return ok


def checked_by(check: Callable[[Any], None]) -> AfterValidator:
    """A field checked by ``check`` (which raises :class:`BadInput`), defined beside the code
    that reads the value (the engine's sample request, say) and run here for the tool."""

    def run(value: Any) -> Any:
        check(value)
        return value

    return AfterValidator(run)


def check_given_tasks(tasks: list[str] | None) -> None:
    """``evaluate``'s tasks, when given, as the model process checks them."""
    if tasks is not None:
        check_tasks(tasks)


def refusal(error: BaseException | None) -> BadInput | None:
    """The first refusal of a field's own check (:func:`must`, :func:`checked_by`) in ``error``
    (a validation error), whose message says what to change; None when it holds none."""
    for problem in error.errors() if isinstance(error, ValidationError) else ():
        raised = (problem.get("ctx") or {}).get("error")
        if isinstance(raised, BadInput):
            return raised
    return None


def invalid(error: ValidationError) -> BadInput:
    """``error`` as one bad-input message: a field's own refusal, or each type problem as
    ``field: what pydantic says``."""
    return refusal(error) or BadInput("; ".join(
        f"{'.'.join(str(p) for p in problem['loc'])}: {problem['msg']}" for problem in error.errors()))


class ToolArgs(BaseModel):
    """A tool's arguments, as both faces validate them (each model built at its first use: a
    server lists its tools from cached schemas, :mod:`mcp_server.schema_cache`)."""

    model_config = ConfigDict(extra="forbid", defer_build=True)

    @classmethod
    def checked(cls, **values: Any) -> Self:
        """``values`` validated as the tool validates them (a Python caller's way in), or
        :class:`BadInput`."""
        try:
            return cls.model_validate(values)
        except ValidationError as e:
            raise invalid(e) from None


RunId = Annotated[str, Field(), Cli(more="A run id (`trainwright runs` lists them).")]
RecipePath = Annotated[str, Field(description="recipes/<name>, or the name.")]
Step = Annotated[int | None, Field(strict=True, description="Default: latest."),
                 Cli(metavar="N", more="The checkpoint's step.")]
Nproc = Annotated[int, must(within(1, MAX_NPROC), f"between 1 and {MAX_NPROC}")]
KeyValues = Cli(flag="--set", metavar="KEY=VALUE", repeat=True, key_values=True,
                more="Repeatable: --set train.max_steps=50.")


# ---------------------------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------------------------


class NoArgs(ToolArgs):
    pass


class GetSkillArgs(ToolArgs):
    skill: Annotated[str, Field(description="A name from list_skills.")]


class ApplySkillArgs(ToolArgs):
    skill: Annotated[str, Field(description="A name from list_skills.")]
    recipe: Annotated[str, Field(description="recipes/<name>, the name, or a .py script.")]
    params: Annotated[dict[str, Any] | None, Field(description="See get_skill."),
                      Cli(flag="--param", metavar="KEY=VALUE", repeat=True, key_values=True)] = None
    dry_run: Annotated[bool, Field(strict=True, description="Return the diff only.")] = False
    target: Annotated[str | None, Field(description="Model to act on: self._model, file.py:LINE."),
                      Cli(metavar="EXPR", more="A refusal lists the candidates it saw.")] = None


class ScaffoldArgs(ToolArgs):
    template: Annotated[str, Field(description="A name from list_templates.")]
    name: Annotated[str, Field(description="The new recipes/<name>/.")]
    config: Annotated[dict[str, Any] | None, Field(description='Dotted: {"train.max_steps": 500}.'),
                      Cli(flag="--config", metavar="KEY=VALUE", repeat=True, key_values=True,
                          more="Written to config.yaml; repeatable.")] = None
    skills: Annotated[list[str | dict[str, Any]] | None, Field(description="Names, or {name, params}."),
                      Cli(flag="--skill", metavar="SKILL", repeat=True,
                          more="Each applied after scaffolding, as its own commit.")] = None


def _check_keys(keys: list[str]) -> None:
    if len(keys) > MAX_KEYS_ASKED:
        raise BadInput(f"keys: at most {MAX_KEYS_ASKED}, got {len(keys)}")
    if any(len(k) > MAX_KEY_CHARS for k in keys):
        raise BadInput(f"keys: a key has at most {MAX_KEY_CHARS} characters (a dotted config key such as optim.lr)")
    if not all(k.strip().strip(".") for k in keys):
        raise BadInput("keys: an empty key; give dotted keys or their start (train, train.lr)")


class RecipeArgs(ToolArgs):
    recipe: RecipePath


class DescribeArgs(RecipeArgs):
    keys: Annotated[list[str], Field(description="Only these keys or sections."), checked_by(_check_keys),
                    Cli(flag="--key", metavar="KEY", repeat=True, more="A dotted key or its start (train); repeatable.")] = []


class LaunchRunArgs(ToolArgs):
    recipe: Annotated[str, Field(description="Recipe folder, or a .py script."),
                      Cli(more="A training script is a .py file or a folder with a train.py, relative to the "
                          "workspace; its own command line follows -- at the end.")]
    nproc: Annotated[Nproc, Field(strict=True, description="Processes per node.")] = 1
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
    resume_arg: Annotated[str, Field(description="Script flag for a checkpoint path."),
                          Cli(metavar="OPTION", more="Given with = (--resume-arg=--resume): `trainwright "
                              "resume` passes the checkpoint with it.")] = ""
    commit: Annotated[str, Field(description="This commit's code (sha, sha^)."),
                      Cli(metavar="REV", more="Not the folder as it is now.")] = ""


class EstimateArgs(ToolArgs):
    recipe: RecipePath
    overrides: Annotated[dict[str, Any] | None, Field(description="As launch_run's."), KeyValues] = None
    nproc: Annotated[Nproc, Field(strict=True, description="Processes.")] = 1
    device: Annotated[Literal["cpu", "cuda"], Field(description="Device class.")] = "cpu"
    device_memory_gib: Annotated[float | None, Field(strict=True, description="Per process: does it fit?"),
                                 must(within(0, MAX_DEVICE_MEMORY_GIB, above=True), "a number of GiB above 0"),
                                 Cli(metavar="GIB", more="The memory of one device.")] = None


class ListRunsArgs(ToolArgs):
    limit: Annotated[int, Field(strict=True, description=f"1-{MAX_LIST_RUNS}."),
                     must(within(1, MAX_LIST_RUNS), f"an integer between 1 and {MAX_LIST_RUNS}")] = 20


class RunArgs(ToolArgs):
    run_id: RunId


class DataCacheArgs(ToolArgs):
    remove: Annotated[list[str], Field(description="Names, or all."),
                      Cli(flag="--remove", metavar="NAME", repeat=True, more="Repeatable; `all` removes every one.")] = []


class WaitRunArgs(ToolArgs):
    run_id: RunId
    until_step: Annotated[int | None, Field(strict=True, description="Default: end."),
                          must(within(0, math.inf), "a step number (0 or more) or null"), Cli(metavar="N")] = None
    timeout_s: Annotated[float, Field(strict=True, description=f"At most {MAX_WAIT_S}."),
                         must(within(0, MAX_WAIT_S, above=True), f"a number of seconds above 0 and at most {MAX_WAIT_S}",
                              "; call wait_run again to wait longer"),
                         Cli(flag="--timeout", metavar="S", more="Exit 124 when it passes first.")] = DEFAULT_WAIT_S


class TailArgs(ToolArgs):
    run_id: RunId
    n: Annotated[int, Field(strict=True, description=f"1-{MAX_TAIL_RECORDS}."), Cli(flag="-n"),
                 must(within(1, MAX_TAIL_RECORDS), f"an integer between 1 and {MAX_TAIL_RECORDS}")
                 ] = DEFAULT_TAIL_RECORDS
    after_step: Annotated[int | None, Field(strict=True, description="After this step."),
                          Cli(metavar="N")] = None
    follow_resumes: Annotated[bool, Field(strict=True, description="Also the runs it resumed.")] = False


class CompareArgs(ToolArgs):
    run_a: RunId
    run_b: RunId


class ResumeArgs(ToolArgs):
    run_id: RunId
    step: Step = None
    nproc: Annotated[Nproc | None, Field(strict=True, description="Default: as the run.")] = None
    code: Annotated[Literal["checkpoint", "head"],
                    Field(description="checkpoint: run's code; head: recipe now.")] = "checkpoint"
    overrides: Annotated[dict[str, Any] | None, Field(description="As launch_run's."), KeyValues] = None
    args: Annotated[list[str] | None, Field(description="A script's new args."),
                    Cli(after_dashes=True)] = None


class ExportArgs(ToolArgs):
    run_id: RunId
    to: Annotated[str, Field(description="New/empty workspace folder or hub:org/name[@branch]."),
                  Cli(flag="--to", metavar="DIR|hub:ORG/NAME")]
    step: Step = None
    lora: Annotated[Literal["merged", "adapter"], Field(description="LoRA: merged, or a peft adapter.")] = "merged"
    gguf: Annotated[Literal[GGUF_QUANTIZATIONS] | None, Field(  # type: ignore[valid-type]
        description="A GGUF file instead.")] = None
    private: Annotated[bool, Field(description="A new Hub repo is private.")] = False


class SampleArgs(ToolArgs):
    run_id: RunId
    prompts: Annotated[list[str], Field(description=f"Up to {MAX_PROMPTS}"), checked_by(check_prompts),
                       Cli(flag="--prompt", metavar="TEXT", repeat=True, more="Repeatable.")]
    step: Step = None
    max_new_tokens: Annotated[int, Field(strict=True, description=f"1-{MAX_NEW_TOKENS}."),
                              checked_by(check_max_new_tokens)] = 64
    temperature: Annotated[float, Field(strict=True, description="0: greedy."), checked_by(check_temperature)] = 0.0
    think: Annotated[bool | None, Field(description="The template's enable_thinking.")] = None  # None: its default
    images: Annotated[list[str], Field(description="One per prompt (VLM)."),
                      Cli(flag="--image", metavar="PATH", repeat=True, more="Workspace file; repeatable.")] = []


class EvaluateArgs(ToolArgs):
    run_id: RunId
    step: Step = None
    data: Annotated[list[str] | None, Field(description="Files (else held-out split)."),
                    must(within(1, MAX_DATA_PATHS, size=True),
                         f"a path or a list of 1 to {MAX_DATA_PATHS} paths in the workspace"),
                    Cli(metavar="PATH", repeat=True, more="Files or folders; repeatable.")] = None
    tasks: Annotated[list[str] | None, Field(description="lm-eval tasks."),
                     checked_by(check_given_tasks),
                     Cli(flag="--task", metavar="NAME", repeat=True,
                         more="lm-evaluation-harness scores instead of the loss: its own tasks, or YAMLs in the "
                              "workspace's eval_tasks/; repeatable.")] = None
