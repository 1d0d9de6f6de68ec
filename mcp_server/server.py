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

import inspect
import json
import logging
from pathlib import Path
from typing import Annotated, Any, Callable

import anyio
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ResourceError, ToolError
from mcp_types import ToolAnnotations
from pydantic import Field

import skills as skill_library
from engine import run_dir as rd
from mcp_server.limits import MAX_ARGUMENTS_CHARS, MAX_ERROR_CHARS, MAX_RESULT_CHARS, bounded, json_chars
from mcp_server.models import (
    ApplySkillResult,
    CheckpointList,
    LaunchRunResult,
    MetricsTail,
    RunInfo,
    RunList,
    ScaffoldResult,
    SkillDetail,
    SkillList,
    TemplateList,
)
from mcp_server.operations import recipes as recipe_ops
from mcp_server.operations import runs as run_ops
from mcp_server.operations import skills as skill_ops
from sandbox.audit import AuditLog
from sandbox.environment import redact
from sandbox.git import GitRefused, ensure_repo
from sandbox.paths import PathRefused
from sandbox.runs import LaunchRefused
from sandbox.workspace import NotFound, Workspace

INSTRUCTIONS = """\
trainwright trains models in this workspace. A typical session:
1. list_templates, then scaffold_recipe(template, name, config, skills) creates recipes/<name>/
   as a commit (config: dotted keys such as {"train.max_steps": 500, "data.paths": [...]}).
2. list_skills / get_skill explain proven training patterns; apply_skill(skill, recipe) writes
   one into the recipe's code as one reviewable commit (dry_run=true shows the diff first).
3. launch_run(recipe, nproc, overrides) starts a run and returns its run_id at once; poll
   get_run / tail_metrics(after_step=...) to watch it; stop_run ends it.
4. list_checkpoints / resume_checkpoint(run_id, step) continue a run as a new run.
Runs outlive this server; list_runs shows them all. Errors say what to change.
"""

READ_ONLY = ToolAnnotations(readOnlyHint=True, destructiveHint=False, idempotentHint=True, openWorldHint=False)
ADDITIVE = ToolAnnotations(readOnlyHint=False, destructiveHint=False, idempotentHint=False, openWorldHint=False)
IDEMPOTENT_CHANGE = ToolAnnotations(readOnlyHint=False, destructiveHint=False, idempotentHint=True, openWorldHint=False)
DESTRUCTIVE = ToolAnnotations(readOnlyHint=False, destructiveHint=True, idempotentHint=True, openWorldHint=False)

INPUT_ERRORS = (ValueError, LookupError, PathRefused, LaunchRefused, GitRefused, NotFound, TypeError)

logger = logging.getLogger(__name__)


class AuditedToolError(ToolError):
    """A tool error that :meth:`Tools.call` has already written to the audit log."""


RunId = Annotated[str, Field(description="A run id from launch_run or list_runs.")]
RecipePath = Annotated[
    str, Field(description="Recipe folder (with recipe.py) or .py script, relative to the workspace.")
]


class Tools:
    """The tools of one server, bound to one workspace."""

    def __init__(self, workspace: Workspace):
        self.ws = workspace
        self.audit = AuditLog(workspace.state_dir)

    async def call(self, tool: str, arguments: dict[str, Any], work: Callable[[], Any]) -> Any:
        """Run ``work`` in a worker thread; map errors to tool errors; audit the call."""
        try:
            result = await anyio.to_thread.run_sync(work)
        except (skill_library.SkillError, *INPUT_ERRORS) as e:
            self.refuse(tool, arguments, str(e))
        except Exception as e:  # a bug: the agent still gets a message, the log the traceback
            logger.exception("tool %s failed", tool)
            self.refuse(tool, arguments, f"internal error (a trainwright bug): {type(e).__name__}: {e}")
        size = json_chars(result.model_dump(mode="json")) if hasattr(result, "model_dump") else 0
        if size > MAX_RESULT_CHARS:
            self.refuse(tool, arguments, f"the result is too large ({size:,} characters, at most "
                        f"{MAX_RESULT_CHARS:,}); ask for less (a smaller n or limit)")
        self.audit.record(
            tool, arguments, "ok",
            commit=getattr(result, "commit", None),
            run_id=getattr(result, "run_id", None),
        )
        return result

    def refuse(self, tool: str, arguments: dict[str, Any], message: str) -> None:
        """Audit the failed call and raise its tool error (the message redacted and bounded)."""
        message = bounded(redact(message), MAX_ERROR_CHARS)[0]
        self.audit.record(tool, arguments, "error", error=message)
        raise AuditedToolError(message) from None


class AuditedServer(MCPServer):
    """The MCP server, with every call audited, also those refused before a tool runs."""

    tools: Tools

    async def call_tool(self, name: str, arguments: dict[str, Any], context: Context | None = None):
        size = json_chars(arguments)
        if size > MAX_ARGUMENTS_CHARS:
            message = f"the arguments are too large ({size:,} characters, at most {MAX_ARGUMENTS_CHARS:,})"
            self.tools.audit.record(str(name)[:100], {"size": size}, "error", error=message)
            raise ToolError(message)
        if self._tool_manager.get_tool(name) is None:
            shown = name if len(name) <= 80 else name[:80] + "…"
            message = f"unknown tool {shown!r}; tools: {', '.join(sorted(t.name for t in await self.list_tools()))}"
            self.tools.audit.record(str(name)[:100], arguments, "error", error=message)
            raise ToolError(message)
        try:
            return await super().call_tool(name, arguments, context)
        except ToolError as e:
            if not isinstance(e.__cause__, AuditedToolError):  # unknown tool, schema validation
                self.tools.audit.record(str(name)[:100], arguments, "error", error=str(e))
            raise


def build_server(workspace: Path | str, read_only: bool = False) -> MCPServer:
    ws = Workspace.open(workspace)
    if not read_only:
        ensure_repo(ws.root)
        ws.prepare_state()
    tools = Tools(ws)
    mcp = AuditedServer("trainwright", instructions=INSTRUCTIONS, log_level="WARNING")
    mcp.tools = tools

    def tool(annotations: ToolAnnotations):
        if read_only and not annotations.read_only_hint:
            return lambda fn: fn  # --read-only: tools that change something are not served

        def register(fn):
            # The docstring is what the agent reads: without its source indentation.
            return mcp.tool(annotations=annotations, description=inspect.cleandoc(fn.__doc__ or ""))(fn)

        return register

    # ---------------------------------------------------------------------------------------
    # Skills
    # ---------------------------------------------------------------------------------------

    @tool(READ_ONLY)
    async def list_skills() -> SkillList:
        """List the training skills (gradient checkpointing, tensor parallel, freezing, sequence
        packing, loss guards, ...) that apply_skill can write into a recipe. Use get_skill for
        one skill's full instructions and parameters."""
        return await tools.call("list_skills", {}, skill_ops.list_skills)

    @tool(READ_ONLY)
    async def get_skill(name: Annotated[str, Field(description="A skill name from list_skills.")]) -> SkillDetail:
        """Read one skill: its SKILL.md (goal, when to use it, what the codemod changes, how to
        validate the result) and the JSON schema of its parameters."""
        return await tools.call("get_skill", {"name": name}, lambda: skill_ops.get_skill(name))

    @tool(IDEMPOTENT_CHANGE)
    async def apply_skill(
        skill: Annotated[str, Field(description="A skill name from list_skills.")],
        recipe: RecipePath,
        params: Annotated[dict[str, Any] | None, Field(description="Skill parameters (see get_skill).")] = None,
        dry_run: Annotated[bool, Field(description="Only return the diff; change nothing.")] = False,
    ) -> ApplySkillResult:
        """Write a skill's pattern into a recipe's code as one git commit (message
        `skill(<name>): apply to <recipe>`, trailers Skill-Applied and Skill-Params). Returns the
        diff, the commit and acts_on: what the change acts on, read from the code. Applying again
        changes nothing (changed=false). Refuses when the recipe has uncommitted changes, when the
        skill cannot find where it belongs, or when its change would act on nothing (the message
        says what would work, e.g. a `target` param)."""
        args = {"skill": skill, "recipe": recipe, "params": params, "dry_run": dry_run}
        return await tools.call(
            "apply_skill", args, lambda: skill_ops.apply_skill(tools.ws, skill, recipe, params, dry_run)
        )

    # ---------------------------------------------------------------------------------------
    # Recipes
    # ---------------------------------------------------------------------------------------

    @tool(READ_ONLY)
    async def list_templates() -> TemplateList:
        """List the recipe templates scaffold_recipe can copy."""
        return await tools.call("list_templates", {}, recipe_ops.list_templates)

    @tool(ADDITIVE)
    async def scaffold_recipe(
        template: Annotated[str, Field(description="A template name from list_templates.")],
        name: Annotated[str, Field(description="Name of the new recipe: recipes/<name>/.")],
        config: Annotated[
            dict[str, Any] | None,
            Field(description='Config values, dotted keys: {"train.max_steps": 500, "data.paths": ["data/a.jsonl"]}.'),
        ] = None,
        skills: Annotated[
            list[Any] | None,
            Field(description='Skills to apply after scaffolding: names, or {"name": ..., "params": {...}}.'),
        ] = None,
        ctx: Context | None = None,
    ) -> ScaffoldResult:
        """Create recipes/<name>/ from a template with the given config, as one commit, then
        apply each listed skill as its own commit. A bad config key, an unknown skill or a skill
        that cannot apply fails before anything is written. Takes a few seconds (the engine
        checks the config)."""
        if ctx is not None:
            await ctx.report_progress(0, 2, "checking the config and skills")
        args = {"template": template, "name": name, "config": config, "skills": skills}
        result = await tools.call(
            "scaffold_recipe", args, lambda: recipe_ops.scaffold_recipe(tools.ws, template, name, config, skills)
        )
        if ctx is not None:
            await ctx.report_progress(2, 2, "scaffolded")
        return result

    # ---------------------------------------------------------------------------------------
    # Runs
    # ---------------------------------------------------------------------------------------

    @tool(ADDITIVE)
    async def launch_run(
        recipe: RecipePath,
        nproc: Annotated[int, Field(description="Processes (FSDP2 data-parallel ranks).")] = 1,
        overrides: Annotated[
            dict[str, Any] | None,
            Field(description='Config overrides, dotted keys: {"train.max_steps": 100}.'),
        ] = None,
        ctx: Context | None = None,
    ) -> LaunchRunResult:
        """Start a training run of a recipe and return its run_id at once (the engine checks the
        config first: a bad key fails here, with nothing written). The run continues in the
        background and outlives this server; watch it with get_run and tail_metrics."""
        if ctx is not None:
            await ctx.report_progress(0, 2, "checking the recipe and config")
        args = {"recipe": recipe, "nproc": nproc, "overrides": overrides}
        result = await tools.call("launch_run", args, lambda: run_ops.launch_run(tools.ws, recipe, nproc, overrides))
        if ctx is not None:
            await ctx.report_progress(2, 2, f"started {result.run_id}")
        return result

    @tool(READ_ONLY)
    async def list_runs(
        limit: Annotated[int, Field(description="At most this many runs, newest first (1-100).")] = 50,
    ) -> RunList:
        """List the workspace's runs, newest first, with status, latest step and loss."""
        return await tools.call("list_runs", {"limit": limit}, lambda: run_ops.list_runs(tools.ws, limit))

    @tool(READ_ONLY)
    async def get_run(run_id: RunId) -> RunInfo:
        """A run's status (running, completed, failed, stopped), latest metrics, ETA,
        checkpoints, and the end of its console log when it failed."""
        return await tools.call("get_run", {"run_id": run_id}, lambda: run_ops.get_run(tools.ws, run_id))

    @tool(READ_ONLY)
    async def tail_metrics(
        run_id: RunId,
        n: Annotated[int, Field(description="At most this many records (1-200).")] = 20,
        after_step: Annotated[
            int | None, Field(description="Only records after this step: pass the last step you saw to poll.")
        ] = None,
    ) -> MetricsTail:
        """The latest metrics records of a run (loss, lr, grad_norm, tokens_per_s, step time,
        memory, MFU). truncated=true means more records matched than n."""
        args = {"run_id": run_id, "n": n, "after_step": after_step}
        return await tools.call("tail_metrics", args, lambda: run_ops.tail_metrics(tools.ws, run_id, n, after_step))

    @tool(DESTRUCTIVE)
    async def stop_run(run_id: RunId) -> RunInfo:
        """Stop a run: all its processes end and it is recorded as stopped. Its complete
        checkpoints stay, so it can be resumed."""
        return await tools.call("stop_run", {"run_id": run_id}, lambda: run_ops.stop_run(tools.ws, run_id))

    @tool(READ_ONLY)
    async def list_checkpoints(run_id: RunId) -> CheckpointList:
        """The complete checkpoints of a run (interrupted saves are never listed)."""
        return await tools.call(
            "list_checkpoints", {"run_id": run_id}, lambda: run_ops.list_checkpoints(tools.ws, run_id)
        )

    @tool(ADDITIVE)
    async def resume_checkpoint(
        run_id: RunId,
        step: Annotated[int | None, Field(description="Checkpoint step; default: the latest complete one.")] = None,
        nproc: Annotated[int | None, Field(description="Processes; default: as the original run.")] = None,
    ) -> LaunchRunResult:
        """Continue a run from one of its checkpoints as a new run (same recipe and config);
        returns the new run_id at once, with resumed_from."""
        args = {"run_id": run_id, "step": step, "nproc": nproc}
        return await tools.call(
            "resume_checkpoint", args, lambda: run_ops.resume_checkpoint(tools.ws, run_id, step, nproc)
        )

    # ---------------------------------------------------------------------------------------
    # Resources
    # ---------------------------------------------------------------------------------------

    for info in skill_library.list_skill_cards():
        _add_skill_resource(mcp, info.name, info.description)

    @mcp.resource("run://{run_id}/metrics", mime_type="application/json",
                  description="The latest metrics records of a run (at most 200), as JSON.")
    def run_metrics(run_id: str) -> str:
        tail = _resource(lambda: run_ops.tail_metrics(tools.ws, run_id, run_ops.MAX_TAIL_RECORDS))
        return tail.model_dump_json()

    @mcp.resource("run://{run_id}/log", mime_type="text/plain",
                  description="The end of a run's console log (at most 20 kB).")
    def run_log(run_id: str) -> str:
        run_dir = _resource(lambda: tools.ws.run_dir(run_id))
        return run_ops._tail_text(run_dir / rd.CONSOLE_LOG, 20_000) or ""

    @mcp.resource("run://{run_id}/loss.png", mime_type="image/png",
                  description="A picture of the run's loss curve (and learning rate).")
    def run_loss_png(run_id: str) -> bytes:
        from mcp_server.plot import loss_curve_png

        run_dir = _resource(lambda: tools.ws.run_dir(run_id))
        records = rd.read_all_metrics(run_dir / rd.METRICS_JSONL)
        return loss_curve_png(records, f"run {run_id}")

    return mcp


def _add_skill_resource(mcp: MCPServer, name: str, description: str) -> None:
    @mcp.resource(f"skill://{name}", name=name, description=description, mime_type="text/markdown")
    def skill_md() -> str:
        return skill_library.get_skill(name).skill_md


def _resource(work: Callable[[], Any]) -> Any:
    try:
        return work()
    except INPUT_ERRORS as e:
        raise ResourceError(str(e)) from None


def tool_schemas(server: MCPServer) -> list[dict[str, Any]]:
    """The agent-facing surface, as snapshotted in tests/mcp/tool_schemas.json."""

    async def collect():
        tools = await server.list_tools()
        return [json.loads(t.model_dump_json(by_alias=True, exclude_none=True)) for t in tools]

    return sorted(anyio.run(collect), key=lambda t: t["name"])


def serve(workspace: Path | str, http_port: int | None = None, read_only: bool = False) -> None:
    server = build_server(workspace, read_only=read_only)
    if http_port is None:
        server.run("stdio")
    else:
        server.run("streamable-http", host="127.0.0.1", port=http_port)
