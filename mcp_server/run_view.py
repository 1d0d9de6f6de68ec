"""The view of a run as an MCP App (the ``io.modelcontextprotocol/ui`` extension, ``mcp.server.apps``).

``get_run`` and ``wait_run`` carry ``_meta.ui.resourceUri`` = :data:`RESOURCE_URI`. A host that
renders MCP Apps (Claude Desktop, claude.ai, VS Code, Cursor) reads that resource, an HTML page
(``run_view.html`` beside this file), and shows it in a sandboxed iframe beside the tool's
result: the run's loss curve, tokens/s, status and, for a failed run, its error and console
end. The page follows the run as it logs: through the host it calls ``get_run`` and
``tail_metrics`` every 2 s until the run ends. A client without Apps ignores the metadata and
reads the text result, which is complete either way.

The page is self-contained (no script, style or font from elsewhere; it asks for no network
origin, so a host applies the spec's restrictive default CSP) and writes run data, which run
code controls, only as text (``textContent``, numbers into SVG attributes), never as markup.
"""

from __future__ import annotations

from functools import lru_cache
from importlib.resources import files
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mcp.server.apps import Apps

RESOURCE_URI = "ui://trainwright/run"
# What get_run and wait_run carry in tools/list: the one definition of the binding.
TOOL_META: dict[str, Any] = {"ui": {"resourceUri": RESOURCE_URI}}
PAGE_FILE = "run_view.html"


@lru_cache(maxsize=1)
def page() -> str:
    """The HTML of the view, as installed with the package."""
    return (files("mcp_server") / PAGE_FILE).read_text(encoding="utf-8")


def extension() -> Apps:
    """The Apps extension of the server: the ``ui://`` page, and the capability it advertises."""
    from mcp.server.apps import Apps  # the server's alone: the CLI reads TOOL_META without the SDK

    apps = Apps()
    apps.add_html_resource(
        RESOURCE_URI, page(), name="run_view", title="trainwright run",
        description="A run's loss curve, tokens/s and status, following the run (get_run, wait_run).",
        prefers_border=True,
    )
    return apps
