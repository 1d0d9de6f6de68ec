"""A hostile recipe under export_checkpoint and evaluate: the model process runs recipe code, so
it gets the run sandbox; it cannot write the workspace or the export's destination directly, read
a host file or another run, leave a process behind, or outlive its time limit.

One short run of a recipe whose module, when imported by ``engine.model_io`` (never by the
launch check or the run), probes what it can reach and writes what it found into the export.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest

from engine import run_dir as rd
from engine import run_checkpoints
from mcp_server.operations import model_tools
from mcp_server.operations import launch as launching
from runner import model_process
from runner.model_process import ModelProcessFailed
from workspace.workspace import Workspace
from tests.mcp.conftest import SHORT_RUN, tiny_config
from tests.sandbox.helpers import derived_recipe, fake_run, make_workspace, wait_final

from tests.sandbox.test_containment import needs_bwrap

pytestmark = [pytest.mark.slow, needs_bwrap]

MARK = "4242.25"  # the detached helper's argument: found on the host if it outlived the tool

PROBE = '''
import sys as _sys

if _sys.argv[0].endswith("model_io.py"):  # only in export / sample / evaluate
    import json as _json, os as _os, subprocess as _sp, time as _time
    from pathlib import Path as _Path

    _found = {}

    def _try(name, action):
        try:
            _found[name] = repr(action())[:200]
        except Exception as e:
            _found[name] = type(e).__name__

    _ws = _Path(_os.environ["TRAINWRIGHT_WORKSPACE"])
    _to = _Path(_sys.argv[_sys.argv.index("--to") + 1]) if "--to" in _sys.argv else None
    _final = _Path(_sys.argv[_sys.argv.index("--final-dir") + 1]) if "--final-dir" in _sys.argv else None
    _try("write_workspace", lambda: (_ws / "pwned.txt").write_text("x"))
    _try("write_final", lambda: _final.mkdir(parents=True))
    _try("write_beside_staging", lambda: (_to.parent / "pwned").mkdir())
    _try("read_outside", lambda: _Path(OUTSIDE).read_text())
    _try("other_run", lambda: (_ws / "runs" / "other" / "run.json").read_text())
    _try("runs_listed", lambda: sorted(_os.listdir(_ws / "runs")))
    _checkpoint = _Path(_sys.argv[2]) / "checkpoints" / f"step-{int(_sys.argv[_sys.argv.index('--step') + 1]):08d}"
    _try("checkpoint_extra", lambda: (_checkpoint / "secret.txt").read_text())
    _sp.Popen(["sleep", MARK], start_new_session=True)
    if "evaluate" in _sys.argv:
        while True:
            _time.sleep(1)
    if _to is not None:
        (_to / "probe.json").write_text(_json.dumps(_found))
'''


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile-model")
    outside = root / "outside.txt"
    outside.write_text("host file outside the workspace")
    workspace = make_workspace(root / "ws")
    body = "class Hostile(CausalLM):\n    pass\n" + PROBE.replace("OUTSIDE", repr(str(outside))).replace(
        "MARK", repr(MARK))
    derived_recipe(workspace, "hostile", body)
    fake_run(workspace, "other")
    ws = Workspace.open(workspace)
    run_id = launching.launch_run(ws, "hostile", overrides=tiny_config(**SHORT_RUN)).run_id
    assert wait_final(ws.run_dir(run_id)).status == rd.COMPLETED
    return ws, run_id


def leftovers() -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:2] == [b"sleep", MARK.encode()]:
                found.append(int(pid))
        except OSError:
            pass
    return found


def test_an_export_runs_the_recipe_where_it_reaches_only_its_staging_folder(hostile, monkeypatch, tmp_path):
    ws, run_id = hostile
    # A run still running writes its checkpoints folder: between the server's check (a real
    # folder) and the sandbox's start it can put a link to a host folder in its place.
    checkpoint = ws.run_dir(run_id) / rd.CHECKPOINTS_DIRNAME / run_checkpoints.checkpoint_dir_name(3)
    host_folder = tmp_path / "host-folder"
    shutil.copytree(checkpoint, host_folder)  # a loadable checkpoint, so the export completes
    (host_folder / "secret.txt").write_text("host secret")
    real = model_process.run_contained

    def swapped(*args, **kwargs):
        moved = checkpoint.with_name("moved")
        os.rename(checkpoint, moved)
        checkpoint.symlink_to(host_folder)
        try:
            return real(*args, **kwargs)
        finally:
            checkpoint.unlink()
            os.rename(moved, checkpoint)

    monkeypatch.setattr(model_process, "run_contained", swapped)
    result = model_tools.export_checkpoint(ws, run_id, "exports/m", step=3)
    assert "probe.json" in result.files and "model.safetensors" in result.files
    found = json.loads((ws.root / "exports" / "m" / "probe.json").read_text())
    assert found["checkpoint_extra"] == "FileNotFoundError", found
    assert found["write_workspace"] in ("OSError", "PermissionError"), found
    assert found["write_final"] in ("OSError", "PermissionError"), found
    assert found["write_beside_staging"] in ("OSError", "PermissionError"), found
    assert found["read_outside"] == "FileNotFoundError" and found["other_run"] == "FileNotFoundError", found
    assert found["runs_listed"] == repr([run_id]), found
    assert not (ws.root / "pwned.txt").exists() and sorted(os.listdir(ws.root / "exports")) == ["m"]
    assert leftovers() == []


def test_a_model_process_that_never_ends_is_stopped_at_its_limit_with_everything_it_started(
        hostile, monkeypatch):
    ws, run_id = hostile
    monkeypatch.setattr(model_tools, "EVALUATE_TIMEOUT_S", 8)
    started = time.monotonic()
    with pytest.raises(ModelProcessFailed, match="evaluate took over 8 s and was stopped"):
        model_tools.evaluate(ws, run_id)
    assert time.monotonic() - started < 30
    assert leftovers() == []
