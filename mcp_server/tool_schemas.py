"""Each tool's JSON schemas: generated from its declaration as the SDK does (the arguments
model's fields are the tool's parameters, its result model the output schema), compacted
(:func:`compacted`), and kept on disk, so that a server answers ``tools/list`` at its start
without pydantic's schema generation for twenty tools (most of the ~60 ms ``build_server``
spent beyond a minimal MCP server's).

A file holds :func:`built_schemas` of every MCP tool: its input and output schema by tool name.
Its name is a key of everything those schemas are generated from: the source of the
``mcp_server`` and ``engine`` packages (the declarations, their arguments and result models,
the records those use, and this module's compaction), and the versions of trainwright, the MCP
SDK, pydantic and Python. Any change to one of them is a new key, so a file built from other
declarations is never read; a file that cannot be read, or lacks a tool, is built again.
Hashing the sources costs ~3 ms of a start.

``TRAINWRIGHT_SCHEMA_CACHE`` names the folder (default ``$XDG_CACHE_HOME/trainwright/tool-schemas``,
``~/.cache/...`` without it); empty: no cache, every start builds the schemas. The folder keeps
the newest :data:`KEPT_FILES` keys (checkouts and versions side by side). The files are as
trusted as the source they stand for: the user's own cache, which recipe code in the sandbox
does not see (SECURITY.md).
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import logging
import os
import sys
import typing
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

from mcp.server.mcpserver import Context
from mcp.server.mcpserver.tools import Tool
from mcp_types import ToolAnnotations

from mcp_server.declarations import TOOLS, ToolSpec

if TYPE_CHECKING:
    from mcp_server.server import Tools

CACHE_ENV = "TRAINWRIGHT_SCHEMA_CACHE"
SOURCE_PACKAGES = ("mcp_server", "engine")  # every module the declarations import lives in these
KEPT_FILES = 8
ROOT = Path(__file__).resolve().parent.parent

ToolSchemas = dict[str, dict[str, Any]]  # {"inputSchema": ..., "outputSchema": ...}

logger = logging.getLogger(__name__)


def cache_folder() -> Path | None:
    """Where the files are kept (None: no cache)."""
    configured = os.environ.get(CACHE_ENV)
    if configured is not None:
        return Path(configured) if configured else None
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "trainwright" / "tool-schemas"


def declarations_key() -> str:
    """A digest of everything the tool schemas are generated from (the module docstring)."""
    from importlib.metadata import PackageNotFoundError, version

    import pydantic

    digest = hashlib.sha256()
    for name in ("trainwright", "mcp"):
        try:
            digest.update(f"{name}=={version(name)}\n".encode())
        except PackageNotFoundError:
            digest.update(f"{name} not installed\n".encode())
    digest.update(f"pydantic=={pydantic.VERSION}\npython {sys.version_info[:2]}\n".encode())
    for package in SOURCE_PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            digest.update(f"{path.relative_to(ROOT)}\0".encode())
            digest.update(path.read_bytes())
            digest.update(b"\0")
    return digest.hexdigest()[:32]


def load(folder: Path, key: str, names: set[str]) -> dict[str, ToolSchemas] | None:
    """The schemas kept under ``key``, when the file is there, readable and holds every one of
    ``names`` (None otherwise: build them)."""
    try:
        kept = json.loads((folder / f"{key}.json").read_bytes())
    except (OSError, ValueError):
        return None
    if not isinstance(kept, dict) or not names <= kept.keys():
        return None
    if not all(isinstance(kept[n], dict) and isinstance(kept[n].get("inputSchema"), dict)
               and isinstance(kept[n].get("outputSchema"), dict) for n in names):
        return None
    return kept


def store(folder: Path, key: str, schemas: dict[str, ToolSchemas]) -> None:
    """Keep ``schemas`` under ``key`` (atomically), and only the newest :data:`KEPT_FILES` keys.
    A folder that cannot be written costs only the cache: the server starts all the same."""
    from workspace.files import write_atomically

    try:
        folder.mkdir(parents=True, exist_ok=True)
        write_atomically(folder / f"{key}.json", json.dumps(schemas))
        kept = sorted(folder.glob("*.json"), key=lambda p: p.stat().st_mtime_ns, reverse=True)
        for old in kept[KEPT_FILES:]:
            with contextlib.suppress(OSError):
                old.unlink()
    except OSError as e:
        logger.info("tool schemas not cached in %s: %s", folder, e)


def mcp_tool(spec: ToolSpec, tools: Tools | None) -> Tool:
    """``spec`` as an MCP tool: its arguments model's fields are the tool's parameters (the
    schema compacted, :func:`_compact_schema`), its result model the output schema."""
    return compacted(Tool.from_function(ToolFunction(spec, tools), **tool_fields(spec)))


def tool_fields(spec: ToolSpec) -> dict[str, Any]:
    """What a tool is registered with beside its function: name, description, annotations, meta."""
    hints = spec.hints
    # readOnlyHint false is the spec's default, left out as openWorldHint true is (bytes of tools/list).
    annotations = ToolAnnotations(readOnlyHint=hints.read_only or None, destructiveHint=hints.destructive,
                                  idempotentHint=hints.idempotent, openWorldHint=hints.open_world)
    return {"name": spec.name, "description": spec.description, "annotations": annotations, "meta": spec.meta}


def compacted(tool: Tool) -> Tool:
    """``tool`` with its input and output schema compacted in place."""
    for schema, output in ((tool.parameters, False), (tool.fn_metadata.output_schema, True)):
        _compact_schema(schema, output)
        _inline_single_use_definitions(schema)
    return tool


def built_schemas(specs: Iterable[ToolSpec]) -> dict[str, ToolSchemas]:
    """Each tool's input and output schema, generated now from its declaration."""
    schemas: dict[str, ToolSchemas] = {}
    for spec in specs:
        tool = mcp_tool(spec, None)
        assert tool.output_schema is not None, f"{spec.name} declares a result model: it has an output schema"
        schemas[spec.name] = {"inputSchema": tool.parameters, "outputSchema": tool.output_schema}
    return schemas


def served_schemas(cached: bool = True) -> dict[str, ToolSchemas]:
    """Every MCP tool's schemas: from the cache when it holds these declarations' (and then
    without building a model), else built and kept there (the module docstring).
    ``cached=False``: built, the cache neither read nor written."""
    specs = [spec for spec in TOOLS if spec.mcp]  # all of them: a --read-only server reads the same file
    folder = cache_folder() if cached else None
    if folder is None:
        return built_schemas(specs)
    key = declarations_key()
    schemas = load(folder, key, {spec.name for spec in specs})
    if schemas is None:
        schemas = built_schemas(specs)
        store(folder, key, schemas)
    return schemas


class ToolFunction:
    """What the SDK calls for one tool: a callable whose signature is the arguments model's
    fields (each annotated with its ``Field``, as the SDK reads parameters) and the request's
    context; a call goes to :meth:`Tools.run`."""

    def __init__(self, spec: ToolSpec, tools: Tools | None):  # None: built for its schemas alone
        self.spec, self.tools = spec, tools
        hints = typing.get_type_hints(spec.args, include_extras=True)
        parameters = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=hints[name],
                                        default=inspect.Parameter.empty if field.is_required() else field.default)
                      for name, field in spec.args.model_fields.items()]
        parameters.append(inspect.Parameter("ctx", inspect.Parameter.KEYWORD_ONLY, default=None,
                                            annotation=Context | None))
        self.__signature__ = inspect.Signature(parameters, return_annotation=spec.result)
        self.__annotations__ = {**{p.name: p.annotation for p in parameters}, "return": spec.result}
        self.__name__ = self.__qualname__ = spec.name

    async def __call__(self, ctx: Context | None = None, **arguments: Any) -> Any:
        assert self.tools is not None, "a tool built for its schemas alone is never served"
        return await self.tools.run(self.spec, arguments, ctx)


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
