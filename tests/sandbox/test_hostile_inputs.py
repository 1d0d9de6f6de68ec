"""Hostile input, through the real MCP SDK client: every tool refuses with a message, the server
keeps serving, and not one byte changes on disk — in the workspace or outside it.

The workspace holds a committed recipe, a finished run with checkpoints, and links that lead
out of it (to a recipe and a run outside, and in a loop). Hand-written cases cover each tool's
inputs; hypothesis generates more paths, names, numbers and wrong types. No case may start a
run: every launch is refused before anything is spawned (a few cases reach the engine's own
config check, which writes nothing).
"""

from __future__ import annotations

import os
import secrets
import shutil
import time
from pathlib import Path

import pytest

from engine.seams import LaunchVerdict
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from mcp.shared.exceptions import MCPError

from mcp_server.server import build_server
from workspace import git as workspace_git
from tests.sandbox.helpers import (
    AUDIT, derived_recipe, error_text, fake_run, live_client, make_workspace, processes_with_argument, tree_hash,
)
from tests.support import TEMPLATE

RUN_ID = "20260101-000000-lm-abcd"
POISONED_RUN = "20260101-000000-lm-0150"
SKILL = "gradient-checkpointing"
HUGE = "x" * 100_000
SHELL = ["lm; rm -rf /", "$(touch pwned)", "`touch pwned`", "lm && curl evil", "lm | sh", "lm > /tmp/x",
         "'; DROP TABLE runs; --"]
HELPER = f"600.{secrets.randbelow(10**6):06d}"  # the argument of the sneaky recipe's helper
SNEAKY = """
import subprocess
from pathlib import Path

# Recipe code runs in the launch check: it tries to write, to leave a helper behind, then fails.
for target in (Path.cwd() / "pwned", Path(__file__).parent / "pwned", Path(OUTSIDE) / "pwned"):
    try:
        target.write_text("written by recipe code during the launch check\\n")
    except OSError:
        pass
subprocess.Popen(["sleep", HELPER], start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
raise ValueError("this recipe refuses to load")
"""


class Context:
    """The server, its client and the hashes that must not change."""

    def __init__(self, root: Path, outside: Path, client):
        self.root, self.outside, self.client = root, outside, client
        self.before = self.hash()

    def hash(self) -> str:
        return tree_hash(self.root, self.outside)

    def assert_refused(self, tool: str, arguments: dict) -> str:
        result = self.client.call(tool, arguments)
        message = error_text(result)
        assert result.is_error, f"{tool}({_short(arguments)}) was accepted: {message[:300]}"
        assert message.strip(), f"{tool}({_short(arguments)}) failed without a message"
        assert "internal error" not in message, message[:500]
        assert len(message) < 3000, f"the error echoes {len(message)} characters"
        assert not self.client.call("list_templates").is_error, "the server stopped serving"
        assert self.hash() == self.before, f"{tool}({_short(arguments)}) changed files on disk"
        assert not (self.root / "pwned").exists() and not Path("pwned").exists()
        return message


def _short(arguments: dict) -> str:
    text = repr(arguments)
    return text if len(text) < 200 else text[:200] + "…"


@pytest.fixture(scope="module")
def ctx(tmp_path_factory):
    base = tmp_path_factory.mktemp("hostile")
    outside = base / "outside"
    shutil.copytree(TEMPLATE, outside / "recipe", ignore=shutil.ignore_patterns("__pycache__"))
    (outside / "train.py").write_text("print('outside')\n")
    fake_run(outside, RUN_ID.replace("abcd", "0u75"))
    root = make_workspace(base / "ws")
    (root / "scripts").mkdir()
    (root / "scripts" / "notes.txt").write_text("not a recipe\n")
    os.symlink(outside, root / "escape")
    os.symlink(outside / "recipe", root / "recipes" / "evil")
    os.symlink(outside / "train.py", root / "recipes" / "evil.py")
    fake_run(root, RUN_ID)
    poisoned = fake_run(root, POISONED_RUN)
    with open(poisoned / "metrics.jsonl", "a") as f:
        f.write('{"step": "abc"}\n{"step": 9, "x": ' + "[" * 100_000 + "]" * 100_000 + "}\n" + "z" * (2 << 20))
    (root / ".gitignore").write_text((root / ".gitignore").read_text() + "ignored/\n")
    workspace_git.commit_paths(workspace_git.open_repo(root), [root / ".gitignore"], "ignore ignored/", [])
    (root / "ignored").mkdir()
    shutil.copy(TEMPLATE / "recipe.py", root / "ignored" / "train.py")
    os.symlink(outside / "runs" / RUN_ID.replace("abcd", "0u75"), root / "runs" / "20260101-000000-lm-link")
    os.symlink("loop", root / "runs" / "loop")
    derived_recipe(root, "sneaky", f"OUTSIDE, HELPER = {str(outside)!r}, {HELPER!r}\n" + SNEAKY)
    server = build_server(root)
    with live_client(server) as client:
        context = Context(root, outside, client)
        yield context
    assert (root / AUDIT).is_file()


# ---------------------------------------------------------------------------------------------
# Hand-written cases
# ---------------------------------------------------------------------------------------------

BAD_PATHS = [
    "../outside/recipe", "../../../../../../etc", "/etc", "/", "//etc/passwd", "escape/recipe",
    "escape/train.py", "recipes/evil", "recipes/evil.py", "recipes/lm/../../..", "recipes/lm/../../escape/recipe",
    "recipes/lm\x00", "\x00", "recipes/lm\n", "recipes/lm\r\nX-Injected: 1", "~", "~/recipes/lm", "~root",
    "", "   ", "x" * 5000, "a/" * 600, ".git", ".git/hooks", ".trainwright", f"runs/{RUN_ID}",
    "recipes/nonexistent", "recipes/lm/config.yaml", "scripts/notes.txt", "recipes", ".", "runs/loop",
    "file:///etc/passwd", "\\\\server\\share", "C:\\Windows", "recipes/lm/./../../" + "../" * 20,
    *SHELL,
]
BAD_NAMES = [
    "../etc/passwd", "/etc/passwd", "a/b", "..", ".", ".hidden", "-rf", "--help", "a\x00b", "\x00",
    "x" * 129, HUGE, "", " ", "name with space", "tab\tname", "new\nline", "ünïcödé", "nonexistent",
    "a..b", *SHELL,
]
WRONG_TYPES = [5, -1, 1.5, True, None, [], ["lm"], {}, {"path": "lm"}]
BAD_COUNTS = [0, -1, -(2**63), 2**63, 10**30, 1.5, "two", "", None, [], {}]

CASES: list[tuple[str, dict]] = []
CASES += [("get_skill", {"skill": v}) for v in BAD_NAMES + WRONG_TYPES]
CASES += [("apply_skill", {"skill": SKILL, "recipe": v, "dry_run": True}) for v in BAD_PATHS + WRONG_TYPES]
CASES += [("apply_skill", {"skill": SKILL, "recipe": v}) for v in BAD_PATHS[:12]]
CASES += [("apply_skill", {"skill": v, "recipe": "recipes/lm"}) for v in BAD_NAMES + WRONG_TYPES]
CASES += [("apply_skill", {"skill": SKILL, "recipe": "recipes/lm", "params": v}) for v in [
    {"nonexistent": 1}, {"every": -5}, {"every": 0}, {"every": "x" * 10_000}, {"every": None},
    {"x" * 1000: 1}, "every=1", [1, 2], 5, {"every": {"nested": [1, {"deeper": HUGE[:5000]}]}},
]]
CASES += [("apply_skill", {"skill": SKILL, "recipe": "recipes/lm", "dry_run": v}) for v in ["maybe", 5, [], {}]]
CASES += [("scaffold_recipe", {"template": v, "name": "fresh"}) for v in BAD_NAMES + WRONG_TYPES]
CASES += [("scaffold_recipe", {"template": "causal_lm", "name": v}) for v in
          [n for n in BAD_NAMES if n != "nonexistent"] + WRONG_TYPES + ["lm", "a.b", "lm/x"]]
CASES += [("scaffold_recipe", {"template": "causal_lm", "name": "fresh", "config": v}) for v in [
    {"data.paths": ["/etc/passwd"]}, {"data.paths": ["../outside/train.py"]}, {"data.paths": ["escape/train.py"]},
    {"data": {"paths": ["escape"]}}, {"model.pretrained_path": "/root/.ssh"}, {"model.pretrained_path": "\x00"},
    {"train.max_steps": "x" * 600}, {"": 1}, {"k" * 100 + str(i): i for i in range(100)},
    {"a": {"b": {"c": {"d": {"e": {"f": {"g": {"h": {"i": {"j": 1}}}}}}}}}},
    "train.max_steps=5", [1], 5,
]]
CASES += [("scaffold_recipe", {"template": "causal_lm", "name": "fresh", "skills": v}) for v in [
    ["nonexistent"], ["../skills/lora"], [5], [None], [{"name": "../x"}], [{"name": SKILL, "params": "x"}],
    [{"name": SKILL, "params": {"nonexistent": 1}}], [{"params": {}}], "lora", {"lora": {}},
]]
CASES += [("launch_run", {"recipe": v}) for v in BAD_PATHS + WRONG_TYPES]
CASES += [("launch_run", {"recipe": "recipes/lm", "nproc": v}) for v in BAD_COUNTS + [10**6, 1000]]
CASES += [("launch_run", {"recipe": "recipes/lm", "overrides": v}) for v in [
    {"train.max_steps": "x" * 600}, {"a=b": 1}, {"a\x00b": 1}, {"": 1}, {"data.paths": ["/etc/passwd"]},
    {"data.paths": ["escape/train.py"]}, {"model.pretrained_path": "../outside/recipe"},
    {f"k{i}": i for i in range(100)}, "train.max_steps=5", ["train.max_steps=5"], 5,
]]
# File values in any nesting, and "~", are confined (the engine would read the user's home).
CASES += [("launch_run", {"recipe": "recipes/lm", "overrides": v}) for v in [
    {"data": {"paths": ["/etc/passwd"]}}, {"data": {"paths": ["escape/train.py"]}}, {"data.paths": ["~"]},
    {"data.paths": ["~/.ssh/id_rsa"]}, {"model": {"pretrained_path": "~root"}}, {"model.pretrained_path": "~"},
]]
CASES += [("scaffold_recipe", {"template": "causal_lm", "name": "fresh", "config": v}) for v in [
    {"data.paths": ["~/.aws/credentials"]}, {"model": {"pretrained_path": "~"}},
]]
# These three reach the engine's config check (a subprocess that imports torch: slow, few).
CASES += [("launch_run", {"recipe": "recipes/lm", "overrides": v}) for v in [
    {"train.max_stpes": 5}, {"train.max_steps": "$(touch pwned)"}, {"--help": 1},
]]
CASES += [("list_runs", {"limit": v}) for v in BAD_COUNTS + [101, 10**6]]
CASES += [("describe_recipe", {"recipe": v}) for v in BAD_PATHS + WRONG_TYPES]
CASES += [("wait_run", {"run_id": RUN_ID, "timeout_s": v}) for v in [0, -1, 601, 10**30, "x", None, [], {}]]
CASES += [("wait_run", {"run_id": RUN_ID, "until_step": v}) for v in [-1, -(2**63), "x", 1.5, [], {}]]
for tool in ("get_run", "wait_run", "stop_run", "list_checkpoints", "tail_metrics", "resume_checkpoint"):
    CASES += [(tool, {"run_id": v}) for v in BAD_NAMES + WRONG_TYPES + [
        "20260101-000000-lm-link", "loop", f"{RUN_ID}/../{RUN_ID}", f"runs/{RUN_ID}", f"{RUN_ID}\n",
    ]]
for tool, more in (("export_checkpoint", {"to": "exports/x"}), ("sample", {"prompts": ["x"]}), ("evaluate", {})):
    CASES += [(tool, {"run_id": v, **more}) for v in BAD_NAMES + WRONG_TYPES + [f"runs/{RUN_ID}"]]
CASES += [("export_checkpoint", {"run_id": RUN_ID, "to": v}) for v in BAD_PATHS + WRONG_TYPES + ["recipes/lm", "."]]
CASES += [("export_checkpoint", {"run_id": RUN_ID, "to": "exports/x", "lora": v}) for v in ["", "both", None, 1]]
CASES += [("evaluate", {"run_id": RUN_ID, "data": [v]}) for v in BAD_PATHS]
CASES += [("sample", {"run_id": RUN_ID, "prompts": v}) for v in [[], "x", [1], [None], ["x"] * 9, ["x\x00"], [HUGE]]]
CASES += [("sample", {"run_id": RUN_ID, "prompts": ["x"], "max_new_tokens": v}) for v in BAD_COUNTS + [513]]
CASES += [("sample", {"run_id": RUN_ID, "prompts": ["x"], "temperature": v}) for v in [-1, 6, "hot", 10**30]]
CASES += [("tail_metrics", {"run_id": RUN_ID, "n": v}) for v in BAD_COUNTS + [201]]
CASES += [("tail_metrics", {"run_id": RUN_ID, "after_step": v}) for v in ["x", 1.5, [], {}]]
CASES += [("resume_checkpoint", {"run_id": RUN_ID, "step": v}) for v in [3, 0, -1, 10**18, 2**64, "x", 1.5, []]]
CASES += [("resume_checkpoint", {"run_id": RUN_ID, "nproc": v}) for v in [0, -1, 10**6, "x", 1.5]]
CASES += [(tool, {}) for tool in ("get_skill", "apply_skill", "scaffold_recipe", "launch_run", "get_run",
                                  "stop_run", "tail_metrics", "list_checkpoints", "resume_checkpoint")]
CASES += [(name, {}) for name in ("nope", "", "../get_run", "get_run; rm -rf /", "GET_RUN", "x" * 5000)]
CASES += [("get_run", {"run_id": RUN_ID, "extra": HUGE, "more": [HUGE] * 3})]
# A change whose result would be too large, or that git could not commit, is refused before
# anything is written.
CASES += [("apply_skill", {"skill": "freeze", "recipe": "recipes/lm", "params": {"patterns": ["a" * 90_000]}}),
          ("apply_skill", {"skill": SKILL, "recipe": "ignored/train.py"})]


@pytest.mark.parametrize("tool, arguments", CASES, ids=[f"{i:03d}-{t[:20]}" for i, (t, _) in enumerate(CASES)])
def test_a_hostile_call_is_refused_with_a_message_and_changes_nothing(ctx, tool, arguments):
    ctx.assert_refused(tool, arguments)


def test_there_are_at_least_200_hand_written_cases():
    assert len(CASES) >= 200, len(CASES)


def test_recipe_code_in_the_launch_check_changes_nothing_and_leaves_no_process(ctx):
    message = ctx.assert_refused("launch_run", {"recipe": "recipes/sneaky"})
    assert "refuses to load" in message
    assert not (ctx.root / "recipes" / "sneaky" / "pwned").exists() and not (ctx.outside / "pwned").exists()
    deadline = time.monotonic() + 5
    while processes_with_argument(HELPER) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert processes_with_argument(HELPER) == set(), "a helper started by the check outlived it"


def test_a_refused_path_says_why(ctx):
    assert "outside the workspace" in ctx.assert_refused("launch_run", {"recipe": "recipes/evil"})
    assert "NUL" in ctx.assert_refused("launch_run", {"recipe": "recipes/lm\x00"})
    assert "not a plain name" in ctx.assert_refused("get_run", {"run_id": "../x"})
    assert ".git/" in ctx.assert_refused("apply_skill", {"skill": SKILL, "recipe": ".git", "dry_run": True})
    assert "longer than 128" in ctx.assert_refused("get_skill", {"skill": "x" * 5000})
    assert "arguments are too large" in ctx.assert_refused("get_skill", {"skill": HUGE})
    assert "unknown tool" in ctx.assert_refused("x" * 5000, {})


def test_poisoned_run_output_is_read_and_changes_nothing(ctx):
    for tool, arguments in (("list_runs", {}), ("get_run", {"run_id": POISONED_RUN}),
                            ("tail_metrics", {"run_id": POISONED_RUN, "after_step": 1})):
        result = ctx.client.call(tool, arguments)
        assert not result.is_error, (tool, error_text(result)[:300])
    assert ctx.client.read_resource(f"run://{POISONED_RUN}/loss.png").contents[0].blob
    assert ctx.client.read_resource(f"run://{POISONED_RUN}/status").contents[0].text
    assert ctx.hash() == ctx.before


@pytest.mark.parametrize("uri", [
    "run://..%2F..%2Fetc/log", "run://..%2Foutside/metrics", f"run://{RUN_ID}%00/log",
    "run://20260101-000000-lm-link/log", "run://loop/metrics", "run://nonexistent/loss.png",
    "run://..%2F..%2Fetc/status", "run://20260101-000000-lm-link/status", "run://loop/status",
    "skill://..%2F..%2Fetc%2Fpasswd", "file:///etc/passwd",
])
def test_a_hostile_resource_is_refused(ctx, uri):
    with pytest.raises(MCPError):
        ctx.client.read_resource(uri)
    assert ctx.hash() == ctx.before


# ---------------------------------------------------------------------------------------------
# Generated cases
# ---------------------------------------------------------------------------------------------

SEGMENTS = st.sampled_from(["..", ".", "", "recipes", "lm", "evil", "evil.py", "escape", "recipe", "train.py",
                            "runs", RUN_ID, ".git", ".trainwright", "~", "\x00", "\n", "etc", "passwd",
                            "x" * 300, "loop", "scripts"])
PATHS = st.one_of(
    st.lists(SEGMENTS, min_size=1, max_size=8).map("/".join),
    st.lists(SEGMENTS, min_size=1, max_size=8).map(lambda parts: "/" + "/".join(parts)),
    st.text(max_size=300),
    st.text(alphabet=st.sampled_from("./\\~\x00\n$`;|&*?"), max_size=50),
)
ANY_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=50),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)
SETTINGS = settings(max_examples=60, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def _is_usable_recipe(root: Path, value: str, scripts: bool) -> bool:
    """An independent oracle: would ``value`` name a recipe (or script) inside the workspace?"""
    if "\x00" in value or not value.strip() or len(value) > 1024 or any(ord(c) < 32 or ord(c) == 127 for c in value):
        return False
    try:
        real = Path(os.path.realpath(root / value))
    except (OSError, ValueError):
        return False
    root = root.resolve()
    if real == root or root not in real.parents or real.relative_to(root).parts[0] in (".git", ".trainwright", "runs"):
        return False
    return (real / "recipe.py").is_file() or (scripts and real.suffix == ".py" and real.is_file())


@SETTINGS
@given(recipe=PATHS)
def test_generated_recipe_paths_are_confined(ctx, recipe):
    assume(not _is_usable_recipe(ctx.root, recipe, scripts=False))
    assume(not (recipe.strip() and "/" not in recipe and (ctx.root / "recipes" / recipe / "recipe.py").is_file()))
    ctx.assert_refused("launch_run", {"recipe": recipe})


@SETTINGS
@given(recipe=PATHS)
def test_generated_skill_targets_are_confined(ctx, recipe):
    assume(not _is_usable_recipe(ctx.root, recipe, scripts=True))
    assume(not (recipe.strip() and "/" not in recipe and (ctx.root / "recipes" / recipe / "recipe.py").is_file()))
    ctx.assert_refused("apply_skill", {"skill": SKILL, "recipe": recipe, "dry_run": True})


@SETTINGS
@given(tool=st.sampled_from(["get_run", "stop_run", "list_checkpoints", "tail_metrics", "resume_checkpoint"]),
       run_id=st.one_of(st.text(max_size=200), PATHS))
def test_generated_run_ids_are_refused(ctx, tool, run_id):
    assume(run_id != RUN_ID)
    ctx.assert_refused(tool, {"run_id": run_id})


@SETTINGS
@given(name=st.one_of(st.text(max_size=200), PATHS), tool=st.sampled_from(["get_skill", "scaffold_recipe"]))
def test_generated_names_are_refused(ctx, name, tool):
    import skills

    if tool == "get_skill":
        assume(name not in {s.name for s in skills.list_skills()})
        ctx.assert_refused("get_skill", {"skill": name})
    else:
        ctx.assert_refused("scaffold_recipe", {"template": name, "name": "fresh"} if name != "causal_lm" else {"template": "causal_lm", "name": "../x"})


@SETTINGS
@given(nproc=st.one_of(st.integers(max_value=0), st.integers(min_value=10**3), st.floats(allow_nan=True).filter(lambda f: f != int(f) if f == f and abs(f) != float("inf") else True), st.text()),
       n=st.one_of(st.integers(max_value=0), st.integers(min_value=201)),
       limit=st.one_of(st.integers(max_value=0), st.integers(min_value=101)))
def test_generated_out_of_range_numbers_are_refused(ctx, nproc, n, limit):
    ctx.assert_refused("launch_run", {"recipe": "recipes/lm", "nproc": nproc})
    ctx.assert_refused("tail_metrics", {"run_id": RUN_ID, "n": n})
    ctx.assert_refused("list_runs", {"limit": limit})
    ctx.assert_refused("resume_checkpoint", {"run_id": RUN_ID, "nproc": n if n <= 0 else 10**6})


@SETTINGS
@given(value=ANY_JSON.filter(lambda v: not isinstance(v, str)),
       tool_and_key=st.sampled_from([("get_skill", "skill"), ("get_run", "run_id"), ("launch_run", "recipe"),
                                     ("list_checkpoints", "run_id"), ("stop_run", "run_id")]))
def test_generated_wrong_types_are_refused(ctx, value, tool_and_key):
    tool, key = tool_and_key
    ctx.assert_refused(tool, {key: value})


@SETTINGS
@given(params=st.dictionaries(st.text(max_size=30).filter(lambda k: k != "every"), ANY_JSON, min_size=1, max_size=5))
def test_generated_skill_params_are_refused(ctx, params):
    ctx.assert_refused("apply_skill", {"skill": SKILL, "recipe": "recipes/lm", "params": params})


def test_a_link_the_parent_run_left_among_its_checkpoints_is_not_resumed(tmp_path, monkeypatch):
    from mcp_server.operations import launch as launching
    from runner import lifecycle as run_lifecycle
    from workspace.workspace import Workspace
    from engine import run_dir as rd
    from engine import run_checkpoints

    root = make_workspace(tmp_path / "ws")
    victim = fake_run(root, "20260101-000000-lm-vict")  # another run: hidden from every run's sandbox
    parent = fake_run(root, "20260101-000000-lm-prnt", checkpoints=(4,))
    # What the parent's recipe code can do: its run directory is writable in its sandbox.
    link = parent / rd.CHECKPOINTS_DIRNAME / run_checkpoints.checkpoint_dir_name(2)
    os.symlink(victim / rd.CHECKPOINTS_DIRNAME / run_checkpoints.checkpoint_dir_name(2), link)
    bound = []

    def check_launch(*args, **kwargs):
        return LaunchVerdict(config={"train": {"max_steps": 4}})

    def start_run(workspace, runs_root, plan):
        bound.append(Path(plan.resumed_from.path))
        raise RuntimeError("not started")

    monkeypatch.setattr(run_lifecycle, "check_launch", check_launch)
    monkeypatch.setattr(run_lifecycle, "start_run", start_run)
    try:
        launching.resume_checkpoint(Workspace.open(root), parent.name, step=2, code="head")
    except RuntimeError:
        pass
    except Exception:
        return  # refused: nothing is bound
    # Resumed: what its sandbox binds read-only must be the parent's own checkpoint, not a link out.
    assert bound and bound[0].resolve().is_relative_to(parent.resolve()), bound
