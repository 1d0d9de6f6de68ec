"""The MCP binding: ``trainwright serve`` exposes the operations as tools and resources.

Each tool is a thin, typed function whose docstring is what the agent reads; the work is done
by ``mcp_server.operations``. Every call goes through :meth:`Tools.call`, which turns input
errors into tool errors with an actionable message (cut to a bounded length), refuses a result
too large for an agent's context, and appends the call to the audit log. Calls that the SDK
rejects before they reach a tool (unknown tool, arguments that fail the schema, arguments too
large) are audited by :class:`AuditedServer`. This module never imports torch: runs are
separate processes.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
from collections import Counter
from pathlib import Path
from typing import Annotated, Any, AsyncIterator, Callable, Literal

import anyio
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ResourceError, ToolError
from mcp.server.session import ServerSession
from mcp.server.subscriptions import InMemorySubscriptionBus
from mcp.shared.exceptions import MCPError
from mcp_types import (INVALID_PARAMS, SetLevelRequestParams, SubscribeRequestParams, ToolAnnotations,
                       UnsubscribeRequestParams)
from pydantic import Field

import skills as skill_library
from engine import run_dir as rd
from engine.errors import TrainwrightError
from mcp_server.limits import (
    DEFAULT_TAIL_RECORDS,
    MAX_ARGUMENTS_CHARS,
    MAX_ERROR_CHARS,
    MAX_RESULT_CHARS,
    MAX_TAIL_RECORDS,
    bounded,
    json_chars,
)
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
from engine.model_io import MAX_NEW_TOKENS, MAX_PROMPTS
from mcp_server.operations import model_tools as model_ops
from mcp_server.operations import compare, estimate, recipe_info, waiting
from mcp_server.operations import recipes as recipe_ops
from mcp_server.operations import runs as run_ops
from mcp_server.operations import skills as skill_ops
from mcp_server import clients, run_view, workflows
from mcp_server.live import LiveRuns
from mcp_server.tasks import TasksExtension
from sandbox.audit import AuditLog
from sandbox import redact as redaction
from sandbox.config import trusted_limits
from sandbox.git import ensure_repo
from sandbox.redact import printable, redact, redact_model, shown
from sandbox.workspace import Workspace

INSTRUCTIONS = """\
trainwright trains models in this workspace. The loop: scaffold → apply → launch → wait → stop →
resume → wait.
1. scaffold_recipe(template, name, config, skills) creates recipes/<name>/ as a commit (config:
   dotted keys, {"train.max_steps": 500, "data.paths": [...]}); list_templates names templates,
   describe_recipe lists every config key, list_recipes the recipes.
2. apply_skill(skill, recipe) writes a training pattern (list_skills, get_skill) into the
   recipe's code as one reviewable commit; dry_run=true shows the diff first.
3. launch_run(recipe, nproc, overrides) returns a run_id at once; wait_run(run_id, until_step)
   returns at that step or when the run ends; get_run and tail_metrics show it; stop_run ends it.
   launch_run also runs a plain .py script as it is (args: its command line; its JSON lines
   with a step are its metrics; docs/script-to-recipe.md says what a recipe adds).
4. resume_checkpoint(run_id, step) continues a run as a new run (list_checkpoints has the steps);
   tail_metrics(follow_resumes=true) shows the history across resumes.
5. sample, evaluate and export_checkpoint (a Hugging Face folder) look at a checkpoint's model.
Runs outlive this server; list_runs shows them all. Errors say what to change.
"""

# idempotentHint and destructiveHint mean something only for tools that change something (the
# MCP spec), so a read-only tool says neither.
READ_ONLY = ToolAnnotations(readOnlyHint=True, openWorldHint=False)
ADDITIVE = ToolAnnotations(readOnlyHint=False, destructiveHint=False, openWorldHint=False)
IDEMPOTENT_CHANGE = ToolAnnotations(readOnlyHint=False, destructiveHint=False, idempotentHint=True, openWorldHint=False)
DESTRUCTIVE = ToolAnnotations(readOnlyHint=False, destructiveHint=True, idempotentHint=True, openWorldHint=False)
# Tools that download a model or data set the config names by Hub id reach the Hugging Face Hub:
# open world (the spec's default, so the key is left out).
READ_ONLY_HUB = ToolAnnotations(readOnlyHint=True)
ADDITIVE_HUB = ToolAnnotations(readOnlyHint=False, destructiveHint=False)

logger = logging.getLogger(__name__)


class AuditedToolError(ToolError):
    """A tool error that :meth:`Tools.call` has already written to the audit log."""


RunId = Annotated[str, Field()]
RecipePath = Annotated[str, Field(description="recipes/<name>, or the name.")]
Step = Annotated[int | None, Field(strict=True, description="Default: latest.")]


def session_of(ctx: Context | None) -> ServerSession | None:
    """The session a tool call came on (None when called outside a request)."""
    try:
        return ctx.session if ctx is not None else None
    except ValueError:
        return None


def download_progress(ctx: Context | None) -> Callable[[float, float | None, str], None] | None:
    """For work in a worker thread: a Hub model's download (bytes) as progress notifications
    between 0 and 1 (of the call's 2), each one higher than the last, as MCP requires; and as an
    info log message at each tenth."""
    if ctx is None:
        return None
    last = [0.0]

    def report(done: float, total: float | None, message: str) -> None:
        value = round(min(0.99, done / total), 4) if total else last[0]
        if value <= last[0]:
            return
        tenth_reached = int(value * 10) > int(last[0] * 10)
        last[0] = value
        try:
            anyio.from_thread.run(ctx.report_progress, value, 2, message)
            if tenth_reached:
                anyio.from_thread.run(clients.log, session_of(ctx), "info", f"{message} ({value:.0%})")
        except Exception:  # a client gone away: the download goes on
            logger.debug("progress notification failed", exc_info=True)

    return report


async def log_launched(ctx: Context | None, result: LaunchRunResult, source: str) -> None:
    await clients.log(session_of(ctx), "info", f"run {result.run_id} launched ({source})")


async def log_wait(ctx: Context | None, result: WaitRunResult) -> None:
    if result.reason == "ended":
        await clients.log(session_of(ctx), clients.ENDED_LEVELS.get(result.status, "info"),
                          f"run {result.run_id} {result.status}" + (f": {result.error}" if result.error else ""))


class Tools:
    """The tools of one server, bound to one workspace."""

    def __init__(self, workspace: Workspace):
        self.ws = workspace
        self.audit = AuditLog(workspace.state_dir, hold=True)

    async def call(self, tool: str, arguments: dict[str, Any], work: Callable[[], Any]) -> Any:
        """Run ``work`` (in a worker thread; a coroutine function on the event loop); map errors
        to tool errors; audit the call."""
        try:
            if inspect.iscoroutinefunction(work):
                result = await work()
            else:
                result = await anyio.to_thread.run_sync(work)
        except TrainwrightError as e:
            self.refuse(tool, arguments, f"{e.kind}: {e}")
        except Exception as e:  # a bug: the agent still gets a message, the log the traceback
            logger.exception("tool %s failed", tool)
            self.refuse(tool, arguments, f"internal: a trainwright bug ({type(e).__name__}: {e}); "
                        "the server log has the traceback")
        if hasattr(result, "model_dump"):  # run output (console, metrics) may print a server secret
            result = redact_model(result)
        size = json_chars(result.model_dump(mode="json")) if hasattr(result, "model_dump") else 0
        if size > MAX_RESULT_CHARS:
            self.refuse(tool, arguments, f"bad_input: the result is too large ({size:,} characters, at most "
                        f"{MAX_RESULT_CHARS:,}); ask for less (a smaller n or limit)")
        self.audit.record(
            tool, arguments, "ok",
            commit=getattr(result, "commit", None),
            run_id=getattr(result, "run_id", None),
        )
        return result

    def refuse(self, tool: str, arguments: dict[str, Any], message: str) -> None:
        """Audit the failed call and raise its tool error (the message redacted and bounded)."""
        message = bounded(shown(message), MAX_ERROR_CHARS)[0]
        self.audit.record(tool, arguments, "error", error=message)
        raise AuditedToolError(message) from None


class AuditedServer(MCPServer):
    """The MCP server, with every call audited, also those refused before a tool runs."""

    tools: Tools

    async def call_tool(self, name: str, arguments: dict[str, Any], context: Context | None = None):
        size = json_chars(arguments)
        if size > MAX_ARGUMENTS_CHARS:
            message = f"bad_input: the arguments are too large ({size:,} characters, at most {MAX_ARGUMENTS_CHARS:,})"
            self.tools.audit.record(str(name)[:100], {"size": size}, "error", error=message)
            raise ToolError(message)
        if self._tool_manager.get_tool(name) is None:
            cut = name if len(name) <= 80 else name[:80] + "…"
            message = printable(f"not_found: unknown tool {cut!r}; tools: "
                                f"{', '.join(sorted(t.name for t in await self.list_tools()))}")
            self.tools.audit.record(str(name)[:100], arguments, "error", error=message)
            raise ToolError(message)
        try:
            return await super().call_tool(name, arguments, context)
        except ToolError as e:
            if isinstance(e.__cause__, AuditedToolError):
                raise
            text = shown(str(e))  # schema validation: it may echo the input
            prefix = printable(f"Error executing tool {name}: ")
            message = prefix + "bad_input: " + (text[len(prefix):] if text.startswith(prefix) else text)
            self.tools.audit.record(str(name)[:100], arguments, "error", error=message)
            raise ToolError(message) from None

    async def get_prompt(self, name: str, arguments: dict[str, Any] | None = None, context: Context | None = None):
        """An unknown prompt, or arguments it does not take, are invalid params (-32602)."""
        known = sorted(p.name for p in await self.list_prompts())
        if name not in known:
            cut = name if len(name) <= 80 else name[:80] + "…"
            raise MCPError(code=INVALID_PARAMS, message=printable(f"unknown prompt {cut!r}; prompts: {', '.join(known)}"))
        try:
            return await super().get_prompt(name, arguments, context)
        except ValueError as e:
            raise MCPError(code=INVALID_PARAMS, message=shown(str(e))[:MAX_ERROR_CHARS]) from None


def build_server(workspace: Path | str, read_only: bool = False, settings: Path | str | None = None) -> MCPServer:
    """The server of one workspace; ``settings``: the trusted settings file (``serve --config``)."""
    redaction.reload()  # the values of this server's secrets, compiled once per start
    ws = Workspace.open(workspace, settings)
    trusted_limits(ws.settings)  # a missing or broken settings file stops the start
    if not read_only:
        ensure_repo(ws.root)
        ws.prepare_state()
    tools = Tools(ws)
    bus = InMemorySubscriptionBus()
    live = LiveRuns(ws, bus)
    tasks = TasksExtension()

    @contextlib.asynccontextmanager
    async def lifespan(server: Any) -> AsyncIterator[dict[str, Any]]:
        async with live.running(server) as state, tasks.running():
            yield state

    mcp = AuditedServer("trainwright", instructions=INSTRUCTIONS, version=package_version(), log_level="WARNING",
                        subscriptions=bus, lifespan=lifespan, middleware=[live.listen_middleware, tasks.legacy],
                        extensions=[run_view.extension(), tasks])
    mcp.tools = tools
    tasks.has_tool = lambda name: mcp._tool_manager.get_tool(name) is not None
    _serve_session_methods(mcp, live)

    def tool(annotations: ToolAnnotations, meta: dict[str, Any] | None = None):
        if read_only and not annotations.read_only_hint:
            return lambda fn: fn  # --read-only: tools that change something are not served

        def register(fn):
            # The docstring is what the agent reads: without its source indentation and line breaks.
            description = inspect.cleandoc(fn.__doc__ or "").replace("\n", " ")
            return mcp.tool(annotations=annotations, description=description, meta=meta)(fn)

        return register

    # ---------------------------------------------------------------------------------------
    # Skills
    # ---------------------------------------------------------------------------------------

    @tool(READ_ONLY)
    async def list_skills() -> SkillList:
        """The skills apply_skill can write; get_skill explains one."""
        return await tools.call("list_skills", {}, skill_ops.list_skills)

    @tool(READ_ONLY)
    async def get_skill(name: Annotated[str, Field(description="A skill name from list_skills.")]) -> SkillDetail:
        """A skill's SKILL.md and parameter schema."""
        return await tools.call("get_skill", {"name": name}, lambda: skill_ops.get_skill(name))

    @tool(IDEMPOTENT_CHANGE)  # idempotent: the annotation says it, the description need not
    async def apply_skill(
        skill: Annotated[str, Field(description="A skill name from list_skills.")],
        recipe: Annotated[str, Field(description="recipes/<name>, the name, or a .py script.")],
        params: Annotated[dict[str, Any] | None, Field(description="Skill parameters (see get_skill).")] = None,
        dry_run: Annotated[bool, Field(strict=True, description="Only return the diff; change nothing.")] = False,
        target: Annotated[str | None, Field(description="The model to act on: self._model, file.py:LINE.")] = None,
    ) -> ApplySkillResult:
        """Write a skill's pattern into a recipe's code as one git commit; a refusal says what
        works."""
        args = {"skill": skill, "recipe": recipe, "params": params, "dry_run": dry_run, "target": target}
        return await tools.call("apply_skill", args, lambda: skill_ops.apply_skill(
            tools.ws, skill, recipe, skill_ops.with_target(params, target), dry_run))

    # ---------------------------------------------------------------------------------------
    # Recipes
    # ---------------------------------------------------------------------------------------

    @tool(READ_ONLY)
    async def list_templates() -> TemplateList:
        """The templates scaffold_recipe can copy."""
        return await tools.call("list_templates", {}, recipe_ops.list_templates)

    @tool(ADDITIVE_HUB)
    async def scaffold_recipe(
        template: Annotated[str, Field(description="A template name from list_templates.")],
        name: Annotated[str, Field(description="The new recipes/<name>/.")],
        config: Annotated[
            dict[str, Any] | None,
            Field(description='Dotted keys: {"train.max_steps": 500}.'),
        ] = None,
        skills: Annotated[
            list[str | dict[str, Any]] | None,
            Field(description="Names, or {name, params}."),
        ] = None,
        ctx: Context | None = None,
    ) -> ScaffoldResult:
        """Create recipes/<name>/ from a template as a commit (one more per skill); a bad key
        or skill writes nothing."""
        if ctx is not None:
            await ctx.report_progress(0, 2, "checking the config and skills")
        args = {"template": template, "name": name, "config": config, "skills": skills}
        result = await tools.call(
            "scaffold_recipe", args,
            lambda: recipe_ops.scaffold_recipe(tools.ws, template, name, config, skills, progress=download_progress(ctx)),
        )
        if ctx is not None:
            await ctx.report_progress(2, 2, "scaffolded")
        return result

    @tool(READ_ONLY_HUB)
    async def describe_recipe(recipe: RecipePath) -> RecipeDescription:
        """Every config key of a recipe or template, skills applied, Hub models."""
        return await tools.call(
            "describe_recipe", {"recipe": recipe}, lambda: recipe_info.describe_recipe(tools.ws, recipe)
        )

    @tool(READ_ONLY)
    async def list_recipes() -> RecipeList:
        """The workspace's recipes: template, last commit, skills, runs."""
        return await tools.call("list_recipes", {}, lambda: recipe_info.list_recipes(tools.ws))

    # ---------------------------------------------------------------------------------------
    # Runs
    # ---------------------------------------------------------------------------------------

    @tool(ADDITIVE_HUB)
    async def launch_run(
        recipe: Annotated[str, Field(description="Recipe folder, or a .py script.")],
        nproc: Annotated[int, Field(strict=True, description="Processes per node.")] = 1,
        overrides: Annotated[
            dict[str, Any] | None,
            Field(description='Config: {"train.max_steps": 100}.'),
        ] = None,
        nnodes: Annotated[int, Field(strict=True, description="Nodes.")] = 1,
        rdzv: Annotated[dict[str, Any], Field(description="nnodes>1: endpoint host:port, id, node_rank.")] = {},
        target: Annotated[Literal["local", "slurm"], Field(description="slurm: sbatch job.")] = "local",
        slurm: Annotated[dict[str, Any], Field(description="partition, time, gpus_per_node.")] = {},
        args: Annotated[list[str], Field(description="Script's command line.")] = [],
        resume_arg: Annotated[str, Field(description="Script option for a checkpoint path.")] = "",
        commit: Annotated[str, Field(description="Run this commit's code (sha, sha^).")] = "",
        ctx: Context | None = None,
    ) -> LaunchRunResult:
        """Run a snapshot of a recipe or .py script (JSON lines with a step: metrics); returns
        run_id at once, or writes nothing on error."""
        if ctx is not None:
            await ctx.report_progress(0, 2, "checking the recipe and config")
        call_args = {"recipe": recipe, "nproc": nproc, "overrides": overrides, "nnodes": nnodes, "rdzv": rdzv,
                     "target": target, "slurm": slurm, "args": args, "resume_arg": resume_arg, "commit": commit}
        result = await tools.call("launch_run", call_args, lambda: run_ops.launch_run(
            tools.ws, recipe, nproc, overrides, nnodes=nnodes, rdzv=rdzv, target=target, slurm=slurm,
            progress=download_progress(ctx), args=args or None, resume_arg=resume_arg or None, commit=commit or None))
        if ctx is not None:
            await ctx.report_progress(2, 2, f"started {result.run_id}")
        await log_launched(ctx, result, recipe)
        return result

    @tool(READ_ONLY_HUB)
    async def estimate_run(
        recipe: RecipePath,
        overrides: Annotated[dict[str, Any] | None, Field(description="As launch_run's.")] = None,
        nproc: Annotated[int, Field(strict=True, description="Processes.")] = 1,
        device: Annotated[Literal["cpu", "cuda"], Field(description="Device class.")] = "cpu",
        device_memory_gib: Annotated[float | None, Field(description="Per process: does it fit?")] = None,
    ) -> EstimateResult:
        """Memory and step time per process before launch_run; over device_memory_gib, changes
        that fit."""
        args = {"recipe": recipe, "overrides": overrides, "nproc": nproc, "device": device,
                "device_memory_gib": device_memory_gib}
        return await tools.call("estimate_run", args, lambda: estimate.estimate_run(
            tools.ws, recipe, overrides, nproc, device, device_memory_gib))

    @tool(READ_ONLY)
    async def list_runs(
        limit: Annotated[int, Field(strict=True, description="1-100.")] = 20,
    ) -> RunList:
        """The workspace's runs, newest first: status, step, loss, mean tokens/s."""
        return await tools.call("list_runs", {"limit": limit}, lambda: run_ops.list_runs(tools.ws, limit))

    @tool(READ_ONLY, meta=run_view.TOOL_META)
    async def get_run(run_id: RunId) -> RunInfo:
        """A run's status, metrics, speed, ETA, checkpoints; a failed run's console end."""
        return await tools.call("get_run", {"run_id": run_id}, lambda: run_ops.get_run(tools.ws, run_id))

    @tool(READ_ONLY, meta=run_view.TOOL_META)
    async def wait_run(
        run_id: RunId,
        until_step: Annotated[
            int | None, Field(strict=True, description="Return once it is logged; default: the end.")
        ] = None,
        timeout_s: Annotated[
            float, Field(strict=True, description=f"At most {waiting.MAX_WAIT_S}.")
        ] = waiting.DEFAULT_WAIT_S,
        ctx: Context | None = None,
    ) -> WaitRunResult:
        """Wait until a run logs until_step, ends, or timeout_s passes (reason)."""

        async def progress(now: waiting.Observation) -> None:
            if ctx is not None:
                await ctx.report_progress(now.step or 0, now.max_steps, now.progress_message())

        async def work() -> WaitRunResult:
            return await waiting.wait_run(tools.ws, run_id, until_step, timeout_s, progress)

        args = {"run_id": run_id, "until_step": until_step, "timeout_s": timeout_s}
        result = await tools.call("wait_run", args, work)
        await log_wait(ctx, result)
        return result

    @tool(READ_ONLY)
    async def tail_metrics(
        run_id: RunId,
        n: Annotated[
            int, Field(strict=True, description="1-200.")
        ] = DEFAULT_TAIL_RECORDS,
        after_step: Annotated[
            int | None, Field(strict=True, description="Only records after this step.")
        ] = None,
        follow_resumes: Annotated[
            bool, Field(strict=True, description="Also the runs it was resumed from.")
        ] = False,
    ) -> MetricsTail:
        """The latest metrics records of a run."""
        args = {"run_id": run_id, "n": n, "after_step": after_step, "follow_resumes": follow_resumes}
        return await tools.call(
            "tail_metrics", args, lambda: run_ops.tail_metrics(tools.ws, run_id, n, after_step, follow_resumes)
        )

    @tool(READ_ONLY)
    async def compare_runs(run_a: RunId, run_b: RunId) -> CompareResult:
        """b vs a: config and code differences, loss at equal tokens, speed, memory, judged at
        the runs' noise."""
        args = {"run_a": run_a, "run_b": run_b}
        return await tools.call("compare_runs", args, lambda: compare.compare_runs(tools.ws, run_a, run_b))

    @tool(DESTRUCTIVE)
    async def stop_run(run_id: RunId) -> StopRunResult:
        """Stop a run and all its processes; checkpoints stay."""
        return await tools.call("stop_run", {"run_id": run_id}, lambda: run_ops.stop_run(tools.ws, run_id))

    @tool(READ_ONLY)
    async def list_checkpoints(run_id: RunId) -> CheckpointList:
        """A run's complete checkpoints."""
        return await tools.call(
            "list_checkpoints", {"run_id": run_id}, lambda: run_ops.list_checkpoints(tools.ws, run_id)
        )

    @tool(ADDITIVE_HUB)
    async def resume_checkpoint(
        run_id: RunId,
        step: Step = None,
        nproc: Annotated[int | None, Field(strict=True, description="Default: as the run.")] = None,
        code: Annotated[
            Literal["checkpoint", "head"],
            Field(description="checkpoint: the run's code; head: the recipe now."),
        ] = "checkpoint",
        overrides: Annotated[
            dict[str, Any] | None,
            Field(description='e.g. {"train.max_steps": 400}'),
        ] = None,
        ctx: Context | None = None,
    ) -> LaunchRunResult:
        """Continue a run from a checkpoint as a new run (its config + overrides)."""
        args = {"run_id": run_id, "step": step, "nproc": nproc, "code": code, "overrides": overrides}
        result = await tools.call(
            "resume_checkpoint", args,
            lambda: run_ops.resume_checkpoint(tools.ws, run_id, step, nproc, overrides=overrides, code=code),
        )
        await log_launched(ctx, result, f"resuming {run_id}")
        return result

    # ---------------------------------------------------------------------------------------
    # Models: export, sample, evaluate (each loads the recipe in the run sandbox)
    # ---------------------------------------------------------------------------------------

    async def in_sandbox(ctx: Context | None, tool_name: str, args: dict[str, Any], work: Callable[[], Any]):
        if ctx is not None:
            await ctx.report_progress(0, 1, "loading the checkpoint in the sandbox")
        result = await tools.call(tool_name, args, work)
        if ctx is not None:
            await ctx.report_progress(1, 1, "done")
        return result

    @tool(ADDITIVE)
    async def export_checkpoint(
        run_id: RunId,
        to: Annotated[str, Field(description="A new or empty folder in the workspace.")],
        step: Step = None,
        lora: Annotated[Literal["merged", "adapter"], Field(description="LoRA runs: merged weights or a peft adapter.")] = "merged",
        ctx: Context | None = None,
    ) -> ExportResult:
        """Write a checkpoint as a Hugging Face folder (weights, config, tokenizer)."""
        args = {"run_id": run_id, "to": to, "step": step, "lora": lora}
        return await in_sandbox(ctx, "export_checkpoint", args,
                                lambda: model_ops.export_checkpoint(tools.ws, run_id, to, step, lora))

    @tool(READ_ONLY)
    async def sample(
        run_id: RunId,
        prompts: Annotated[list[str], Field(description=f"At most {MAX_PROMPTS} texts.")],
        step: Step = None,
        max_new_tokens: Annotated[int, Field(strict=True, description=f"1-{MAX_NEW_TOKENS}.")] = 64,
        temperature: Annotated[float, Field(strict=True, description="0: greedy.")] = 0.0,
        ctx: Context | None = None,
    ) -> SampleResult:
        """Continue prompts with a checkpoint's model."""
        args = {"run_id": run_id, "prompts": prompts, "step": step, "max_new_tokens": max_new_tokens,
                "temperature": temperature}
        return await in_sandbox(ctx, "sample", args, lambda: model_ops.sample(
            tools.ws, run_id, prompts, step, max_new_tokens, temperature))

    @tool(READ_ONLY)
    async def evaluate(
        run_id: RunId,
        step: Step = None,
        data: Annotated[list[str] | None, Field(description="Files; default: the held-out split.")] = None,
        ctx: Context | None = None,
    ) -> EvaluateResult:
        """A checkpoint's eval loss and the recipe's task metrics."""
        args = {"run_id": run_id, "step": step, "data": data}
        return await in_sandbox(ctx, "evaluate", args, lambda: model_ops.evaluate(tools.ws, run_id, step, data))

    # ---------------------------------------------------------------------------------------
    # Resources
    # ---------------------------------------------------------------------------------------

    for info in skill_library.list_skill_cards():
        _add_skill_resource(mcp, info.name, info.description)

    @mcp.resource("run://{run_id}/metrics", mime_type="application/json",
                  description="The latest metrics records (at most 200) of a run's history across resumes, as JSON.")
    def run_metrics(run_id: str) -> str:
        tail = _resource(lambda: run_ops.tail_metrics(tools.ws, run_id, MAX_TAIL_RECORDS, follow_resumes=True))
        return redact_model(tail).model_dump_json()

    @mcp.resource("run://{run_id}/log", mime_type="text/plain",
                  description="The end of a run's console log (at most 20 kB).")
    def run_log(run_id: str) -> str:
        run_dir = _resource(lambda: tools.ws.run_dir(run_id))
        return redact(run_ops._tail_text(run_dir / rd.CONSOLE_LOG, 20_000) or "")

    @mcp.resource("run://{run_id}/status", mime_type="application/json",
                  description="A run's status, latest metrics, ETA and checkpoints (get_run), as JSON.")
    def run_status(run_id: str) -> str:
        return redact_model(_resource(lambda: run_ops.get_run(tools.ws, run_id))).model_dump_json()

    @mcp.resource("run://{run_id}/loss.png", mime_type="image/png",
                  description="The loss curve (and learning rate) of a run's history, each resume marked.")
    def run_loss_png(run_id: str) -> bytes:
        from mcp_server.plot import history_png

        return _resource(lambda: history_png(tools.ws, run_id))

    workflows.register_prompts(mcp)
    workflows.register_completions(mcp, tools.ws)

    for registered in mcp._tool_manager.list_tools():
        for schema, output in ((registered.parameters, False), (registered.fn_metadata.output_schema, True)):
            _compact_schema(schema, output)
            _inline_single_use_definitions(schema)
    return mcp


def package_version() -> str:
    """The installed trainwright's version (serverInfo.version)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("trainwright")
    except PackageNotFoundError:
        return "0+unknown"


def _compact_schema(schema: Any, output: bool = False, names: bool = False) -> None:
    """Make a tool's JSON schema smaller without changing what it accepts, and portable: every
    tool's schemas are sent to the agent in each session, and some clients reject type arrays.

    Drops the ``title`` pydantic gives every schema (the key's name again, in Title Case) and
    ``additionalProperties: true`` (what JSON Schema assumes). An optional argument whose
    default is null (``anyOf: [{type: T}, {type: null}]``, default null) becomes plain
    ``{type: T}`` without the default: leaving it out means null. In output schemas
    (which describe what the server sends: every key, always) it also drops ``required`` lists and
    defaults, and keeps a nullable value's ``anyOf``, since null is sent. An empty default
    (``[]``, ``{}``, ``""``) is left out of input schemas too: leaving the argument out means it. A value of any type
    (``{}``) is said so with ``anyOf``, so that every property has a validation keyword.
    ``names`` marks a mapping of property names, which are kept as they are.
    """
    if isinstance(schema, dict):
        if not names:
            if isinstance(schema.get("title"), str):
                del schema["title"]
            if schema.get("additionalProperties") is True:  # what JSON Schema assumes
                del schema["additionalProperties"]
            if not output and schema.get("default", ...) in ([], {}, ""):  # nothing given means that
                del schema["default"]
            if output:
                schema.pop("default", None)
                if isinstance(schema.get("required"), list):  # the server sends every key, always
                    del schema["required"]
        for key, value in schema.items():  # children first: an option may become plain {type}
            _compact_schema(value, output, names=not names and key in ("properties", "$defs"))
        if names:
            for name, value in schema.items():
                if isinstance(value, dict) and not VALIDATION_KEYWORDS & set(value):
                    value["anyOf"] = [{"type": t} for t in JSON_TYPES]
            return
        options = schema.get("anyOf")
        if (not output and schema.get("default", ...) is None and isinstance(options, list) and len(options) == 2
                and {"type": "null"} in options and all(isinstance(o, dict) for o in options)):
            del schema["anyOf"], schema["default"]
            schema.update(next(o for o in options if o != {"type": "null"}))
    elif isinstance(schema, list):
        for item in schema:
            _compact_schema(item, output)


def _inline_single_use_definitions(schema: Any) -> None:
    """Write each ``$defs`` entry that one ``$ref`` uses in that place: the same schema, read
    top to bottom and shorter."""
    if not isinstance(schema, dict) or not isinstance(schema.get("$defs"), dict):
        return
    refs: list[dict[str, Any]] = []

    def collect(node: Any) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("$ref"), str):
                refs.append(node)
            for value in node.values():
                collect(value)
        elif isinstance(node, list):
            for item in node:
                collect(item)

    collect(schema)
    definitions = schema["$defs"]
    uses = Counter(ref["$ref"] for ref in refs)
    for ref in refs:
        name = ref["$ref"].removeprefix("#/$defs/")
        if uses[ref["$ref"]] == 1 and name in definitions and f'"#/$defs/{name}"' not in json.dumps(definitions[name]):
            del ref["$ref"]
            ref.update(definitions.pop(name))
    if not definitions:
        del schema["$defs"]


VALIDATION_KEYWORDS = frozenset({"type", "enum", "const", "anyOf", "oneOf", "allOf", "not", "$ref"})
JSON_TYPES = ("string", "number", "boolean", "object", "array", "null")


def _serve_session_methods(mcp: MCPServer, live: LiveRuns) -> None:
    """The 2025-11-25 session methods MCPServer leaves unserved: resources/subscribe and
    resources/unsubscribe (for which the server then advertises ``resources.subscribe``) and
    logging/setLevel. MCPServer registers its handlers on its low-level server and offers no
    public way to add these; this is the one place that reaches that server."""
    lowlevel = mcp._lowlevel_server
    lowlevel.add_request_handler("resources/subscribe", SubscribeRequestParams, live.subscribe)
    lowlevel.add_request_handler("resources/unsubscribe", UnsubscribeRequestParams, live.unsubscribe)
    lowlevel.add_request_handler("logging/setLevel", SetLevelRequestParams, clients.set_level)


def _add_skill_resource(mcp: MCPServer, name: str, description: str) -> None:
    @mcp.resource(f"skill://{name}", name=name, description=description, mime_type="text/markdown")
    def skill_md() -> str:
        return skill_library.get_skill(name).skill_md


def _resource(work: Callable[[], Any]) -> Any:
    try:
        return work()
    except TrainwrightError as e:
        raise ResourceError(shown(f"{e.kind}: {e}")) from None


def tool_schemas(server: MCPServer) -> list[dict[str, Any]]:
    """The agent-facing surface, as snapshotted in tests/mcp/tool_schemas.json."""

    async def collect():
        tools = await server.list_tools()
        return [json.loads(t.model_dump_json(by_alias=True, exclude_none=True)) for t in tools]

    return sorted(anyio.run(collect), key=lambda t: t["name"])


def serve(workspace: Path | str, http_port: int | None = None, read_only: bool = False, auth: bool = True,
          settings: Path | str | None = None) -> None:
    server = build_server(workspace, read_only=read_only, settings=settings)
    if http_port is None:
        server.run("stdio")
    else:
        from mcp_server.http_auth import serve_http

        serve_http(server, http_port, auth=auth)
