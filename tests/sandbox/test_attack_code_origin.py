"""A run executes only the code its record names: trainwright's own modules and the recipe's
snapshot, never a module that happens to sit in the workspace.

Runs and launch checks start with the workspace as their working directory; Python would put
that folder first on ``sys.path`` for ``python -m ...``, so a ``sandbox/`` or ``engine/`` package
written into the workspace would replace the supervisor or the engine, and a recipe could import
workspace modules that are in no snapshot, no commit and no dirty flag.
"""

from __future__ import annotations


from mcp_server.server import build_server
from tests.sandbox.helpers import derived_recipe, error_text, live_client, make_workspace, wait_final
from tests.support import TINY
from engine import run_dir as rd

SHADOW = """
import pathlib
pathlib.Path({marker!r}).write_text("workspace code ran instead of trainwright's")
"""


def _tiny(**extra):
    import yaml

    config = {k: yaml.safe_load(v) for k, v in (item.split("=", 1) for item in TINY)}
    return {**config, **extra}


def test_workspace_packages_do_not_replace_the_supervisor_or_the_engine(tmp_path):
    root = make_workspace(tmp_path / "ws")
    marker = tmp_path / "shadowed"
    for package in ("sandbox", "runner", "workspace", "engine"):
        (root / package).mkdir()
        (root / package / "__init__.py").write_text(SHADOW.format(marker=str(marker)))
    with live_client(build_server(root)) as client:
        result = client.call("launch_run", {"recipe": "recipes/lm", "overrides": _tiny(**{"train.max_steps": 2})})
        assert not result.is_error, error_text(result)
        run_id = result.structured_content["run_id"]
        record = wait_final(root / "runs" / run_id, timeout=240)
    assert not marker.exists(), "a package in the workspace ran in place of trainwright's"
    assert record.status == rd.COMPLETED, record.error


def test_a_recipe_cannot_import_uncommitted_workspace_code_outside_its_snapshot(tmp_path):
    root = make_workspace(tmp_path / "ws")
    derived_recipe(root, "uses_outside", "import outside_helper\n\n\nclass Outside(CausalLM):\n    pass\n")
    (root / "outside_helper.py").write_text("VALUE = 1\n")  # never committed, never snapshotted
    with live_client(build_server(root)) as client:
        result = client.call("launch_run", {"recipe": "recipes/uses_outside", "overrides": _tiny()})
    assert result.is_error, "the run would import code that no snapshot, commit or dirty flag records"
    assert "outside_helper" in error_text(result)


def test_resume_refuses_a_snapshot_edited_after_its_run(tmp_path):
    """code="checkpoint" promises the code the checkpoint was trained with: a snapshot changed
    since (by hand, by an agent's file tools) is refused, not run under the original's name."""
    root = make_workspace(tmp_path / "ws")
    marker = tmp_path / "edited-snapshot-ran"
    with live_client(build_server(root)) as client:
        launched = client.call("launch_run", {"recipe": "recipes/lm", "overrides": _tiny(
            **{"train.max_steps": 2, "checkpoint.every": 2})})
        assert not launched.is_error, error_text(launched)
        run_id = launched.structured_content["run_id"]
        assert wait_final(root / "runs" / run_id, timeout=240).status == rd.COMPLETED
        snapshot = root / "runs" / run_id / "recipe" / "recipe.py"
        snapshot.write_text(snapshot.read_text() + f"\nimport pathlib\npathlib.Path({str(marker)!r}).write_text('x')\n")
        runs_before = sorted(p.name for p in (root / "runs").iterdir())
        result = client.call("resume_checkpoint", {"run_id": run_id})
        message = error_text(result)
        assert result.is_error, f"an edited snapshot was resumed as {run_id}'s code: {message[:300]}"
        assert "bad_input:" in message and "code='head'" in message, message
        assert sorted(p.name for p in (root / "runs").iterdir()) == runs_before
    assert not marker.exists()


SWAP_DURING_CHECK = '''
import pathlib
import sys

if "--check" in sys.argv:  # the launch check imports this file from the recipe folder
    here = pathlib.Path(__file__)
    here.write_text(here.read_text().replace("SOURCE = 'random'", "SOURCE = 'stdlib'"))

SOURCE = 'random'


class Swapping(CausalLM):
    @classmethod
    def summarize_data(cls, config):
        summary = super().summarize_data(config)
        return summary.model_copy(update={"source": SOURCE})
'''


def test_a_recipe_that_changes_itself_during_the_check_is_not_run(tmp_path):
    """launch_run reports the config and data the check's code counted; the run must execute
    that same code, not what the recipe (or anyone) wrote into its folder meanwhile."""
    root = make_workspace(tmp_path / "ws")
    derived_recipe(root, "swapper", SWAP_DURING_CHECK)
    with live_client(build_server(root)) as client:
        result = client.call("launch_run", {"recipe": "recipes/swapper", "overrides": _tiny(**{"train.max_steps": 1})})
        message = error_text(result)
        if not result.is_error:
            run_dir = root / "runs" / result.structured_content["run_id"]
            wait_final(run_dir, timeout=240)
            reported = result.structured_content["data"]["source"]
            ran = "stdlib" if "SOURCE = 'stdlib'" in (run_dir / "recipe" / "recipe.py").read_text() else "random"
            raise AssertionError(f"the check's code reported {reported!r}; the run executed code that says {ran!r}")
    # In the sandbox the recipe folder is read-only, so the rewrite itself fails; without it the
    # snapshot's digest differs from the checked code's. Either way nothing runs.
    assert "bad_input:" in message and ("changed" in message or "Read-only file system" in message), message
    assert not (root / "runs").exists() or not any((root / "runs").iterdir())


def test_a_git_ignored_file_the_snapshot_holds_makes_the_recipe_dirty(tmp_path):
    """The snapshot copies every file of the recipe folder, so one git ignores (here through
    .git/info/exclude, which no commit shows) runs too: it must not run under "clean at commit"."""
    root = make_workspace(tmp_path / "ws")
    (root / ".git" / "info").mkdir(exist_ok=True)
    with open(root / ".git" / "info" / "exclude", "a") as f:
        f.write("recipes/lm/local_settings.py\n")
    (root / "recipes" / "lm" / "local_settings.py").write_text("LR = 1.0\n")
    with live_client(build_server(root)) as client:
        result = client.call("launch_run", {"recipe": "recipes/lm", "overrides": _tiny(**{"train.max_steps": 1})})
        assert not result.is_error, error_text(result)
        run_dir = root / "runs" / result.structured_content["run_id"]
        wait_final(run_dir, timeout=240)
        info = client.call("get_run", {"run_id": run_dir.name}).structured_content
    assert (run_dir / "recipe" / "local_settings.py").is_file()
    assert info["recipe_dirty"] is True and "local_settings.py" in info["code"], info["code"]
    assert "local_settings.py" in (run_dir / "recipe" / "uncommitted.patch").read_text()


EDITS_PARENT_CONFIG = '''
import atexit
import json
import pathlib
import sys

if "--check" in sys.argv and "--config-json" in sys.argv:
    parent = pathlib.Path(sys.argv[sys.argv.index("--config-json") + 1])

    def _edit():  # after the check printed its verdict
        record = json.loads(parent.read_text())
        record["config"]["optim"]["lr"] = 0.123
        parent.write_text(json.dumps(record))

    atexit.register(_edit)


class EditsParent(CausalLM):
    pass
'''


def test_a_resume_runs_the_config_its_check_resolved(tmp_path):
    """A resume starts from the parent's recorded config: the run must use the config the check
    resolved and launch_run reported, not the parent's run.json as it is when the run starts."""
    root = make_workspace(tmp_path / "ws")
    derived_recipe(root, "editor", EDITS_PARENT_CONFIG)
    with live_client(build_server(root)) as client:
        first = client.call("launch_run", {"recipe": "recipes/editor", "overrides": _tiny(
            **{"train.max_steps": 2, "checkpoint.every": 2})})
        assert not first.is_error, error_text(first)
        parent = first.structured_content["run_id"]
        assert wait_final(root / "runs" / parent, timeout=240).status == rd.COMPLETED
        resumed = client.call("resume_checkpoint", {"run_id": parent, "overrides": {"train.max_steps": 3}})
        assert not resumed.is_error, error_text(resumed)
        assert "optim.lr" not in resumed.structured_content["config_changes"] or \
            resumed.structured_content["config_changes"]["optim.lr"] != 0.123
        run_dir = root / "runs" / resumed.structured_content["run_id"]
        record = wait_final(run_dir, timeout=240)
    assert record.status == rd.COMPLETED, record.error
    assert record.config["optim"]["lr"] != 0.123, "the run used a config its check never saw"
