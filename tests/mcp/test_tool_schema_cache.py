"""The tool schemas kept on disk (mcp_server/tool_schemas.py): the served tools/list is the one
built from the declarations, byte for byte, whether the cache is empty, filled, broken or out of
reach; a changed declaration is served changed; a server starts without building a tool."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import anyio
import pytest
from mcp import Client

from mcp_server import tool_schemas
from mcp_server.server import build_server

ROOT = Path(__file__).resolve().parents[2]


def tools_list_answer(workspace: Path, **options) -> str:
    """The tools/list answer a client gets from a server in memory, as JSON."""

    async def listing() -> str:
        async with Client(build_server(workspace, **options)) as client:
            return (await client.list_tools()).model_dump_json(by_alias=True, exclude_none=True)

    return anyio.run(listing)


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    folder = tmp_path / "schema-cache"
    monkeypatch.setenv(tool_schemas.CACHE_ENV, str(folder))
    return folder


@pytest.mark.parametrize("read_only", [False, True])
def test_the_served_tool_list_is_byte_identical_to_the_uncached_build(tmp_path, cache, read_only):
    workspace = tmp_path / "ws"
    workspace.mkdir()
    uncached = tools_list_answer(workspace, read_only=read_only, cached_schemas=False)
    assert not cache.exists()  # the uncached build neither reads nor writes the cache
    filling = tools_list_answer(workspace, read_only=read_only)  # an empty cache: built, then kept
    (kept,) = cache.iterdir()
    assert kept.name == f"{tool_schemas.declarations_key()}.json"
    from_file = tools_list_answer(workspace, read_only=read_only)
    assert filling == uncached and from_file == uncached
    assert len(json.loads(uncached)["tools"]) == (14 if read_only else 20)


def test_a_broken_or_partial_cache_file_is_built_again(tmp_path, cache):
    workspace = tmp_path / "ws"
    workspace.mkdir()
    uncached = tools_list_answer(workspace, cached_schemas=False)
    kept = cache / f"{tool_schemas.declarations_key()}.json"
    cache.mkdir()
    for broken in (b"{not json", b"[]", json.dumps({"get_run": {"inputSchema": {}, "outputSchema": {}}}).encode()):
        kept.write_bytes(broken)
        assert tools_list_answer(workspace) == uncached
        assert len(json.loads(kept.read_bytes())) == 20  # written again, whole


def test_a_cache_that_cannot_be_written_costs_only_the_cache(tmp_path, monkeypatch):
    workspace = tmp_path / "ws"
    workspace.mkdir()
    not_a_folder = tmp_path / "a-file"
    not_a_folder.write_text("")
    monkeypatch.setenv(tool_schemas.CACHE_ENV, str(not_a_folder / "cache"))
    assert tools_list_answer(workspace) == tools_list_answer(workspace, cached_schemas=False)


def test_an_empty_setting_turns_the_cache_off(tmp_path, monkeypatch):
    monkeypatch.setenv(tool_schemas.CACHE_ENV, "")
    assert tool_schemas.cache_folder() is None
    monkeypatch.delenv(tool_schemas.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert tool_schemas.cache_folder() == tmp_path / "trainwright" / "tool-schemas"


def test_only_the_newest_keys_are_kept(tmp_path):
    for i in range(tool_schemas.KEPT_FILES + 3):
        tool_schemas.store(tmp_path, f"key{i:02d}", {})
        os.utime(tmp_path / f"key{i:02d}.json", ns=(i * 10**9, i * 10**9))
    tool_schemas.store(tmp_path, "newest", {})
    kept = sorted(p.stem for p in tmp_path.iterdir())
    assert len(kept) == tool_schemas.KEPT_FILES and "newest" in kept and "key00" not in kept


def test_every_project_module_the_declarations_import_is_in_the_key():
    """The key hashes SOURCE_PACKAGES: a project module the tool schemas come from outside them
    would be served from a stale file after a change."""
    probe = ("import sys, mcp_server.declarations; "
             "print('\\n'.join(m.__file__ for m in list(sys.modules.values()) if getattr(m, '__file__', None)))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}).stdout
    environment = Path(sys.prefix).resolve()  # make's .venv lies inside the checkout: its packages are not ours
    project = [Path(f).resolve() for f in out.splitlines()
               if Path(f).resolve().is_relative_to(ROOT) and not Path(f).resolve().is_relative_to(environment)]
    hashed = [ROOT / package for package in tool_schemas.SOURCE_PACKAGES]
    assert ROOT / "mcp_server" / "models.py" in project
    assert [f for f in project if not any(f.is_relative_to(h) for h in hashed)] == []


def test_a_changed_declaration_is_served_changed_from_a_filled_cache(tmp_path):
    """A checkout copied, its cache filled, then one field's description changed in its source:
    the next start serves the new description (a new key), the old file is still there."""
    checkout = tmp_path / "checkout"
    for package in ("mcp_server", "engine", "workspace", "sandbox", "runner", "skills", "trainwright"):
        shutil.copytree(ROOT / package, checkout / package)
    workspace = tmp_path / "ws"
    workspace.mkdir()
    env = {**os.environ, "PYTHONPATH": str(checkout), tool_schemas.CACHE_ENV: str(tmp_path / "cache")}
    probe = ("import json, sys; from mcp_server.server import build_server, tool_schemas; "
             "print(json.dumps(tool_schemas(build_server(sys.argv[1]))))")

    def served() -> dict:
        out = subprocess.run([sys.executable, "-c", probe, str(workspace)], capture_output=True, text=True,
                             check=True, cwd=tmp_path, env=env).stdout
        return {tool["name"]: tool for tool in json.loads(out)}

    def recipe_description(tools: dict) -> str:
        return tools["apply_skill"]["inputSchema"]["properties"]["recipe"]["description"]

    before = served()
    assert recipe_description(before) == "recipes/<name>, the name, or a .py script."
    arguments = checkout / "mcp_server" / "arguments.py"
    source = arguments.read_text()
    assert source.count('"recipes/<name>, the name, or a .py script."') == 1
    arguments.write_text(source.replace('"recipes/<name>, the name, or a .py script."', '"A recipe folder."'))
    after = served()
    assert recipe_description(after) == "A recipe folder."
    assert len(list((tmp_path / "cache").iterdir())) == 2
    changed = [name for name in before if before[name] != after[name]]
    assert "apply_skill" in changed
    for name in changed:  # the description is all that changed
        assert json.dumps(after[name]).replace("A recipe folder.", "recipes/<name>, the name, or a .py script.") == json.dumps(
            before[name]), name


def test_a_server_starts_and_lists_its_tools_without_building_one(tmp_path, cache):
    """With the cache filled, build_server and tools/list build no tool (no pydantic schema for a
    tool's function); the first call builds that tool alone."""
    workspace = tmp_path / "ws"
    workspace.mkdir()
    tools_list_answer(workspace)  # fills the cache
    server = build_server(workspace)

    async def list_then_call():
        async with Client(server) as client:
            await client.list_tools()
            assert server._tool_manager.list_tools() == []
            result = await client.call_tool("list_templates", {})
            assert not result.is_error
            return [tool.name for tool in server._tool_manager.list_tools()]

    assert anyio.run(list_then_call) == ["list_templates"]
