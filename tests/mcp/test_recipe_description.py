"""describe_recipe and list_recipes through a real MCP client (in memory and over stdio)."""

from __future__ import annotations

import json
import shutil

import pytest

from mcp_server.limits import text_bytes
from mcp_server.models import ConfigField, RecipeDescription
from mcp_server.operations.recipe_info import MAX_DESCRIBE_BYTES, _fit
from tests.mcp.conftest import git, head
from tests.support import TEMPLATE


@pytest.fixture(scope="module")
def recipe(client) -> dict:
    return client.ok(
        "scaffold_recipe", template="causal_lm", name="described",
        config={"train.max_steps": 7, "data.seq_len": 64}, skills=["loss-guard"],
    )


def test_describe_recipe_lists_every_config_key_its_template_and_skills(client, workspace, recipe):
    status_before = git(workspace, "status", "--porcelain", "--ignored")

    result = client.ok("describe_recipe", recipe="described")

    assert result["recipe"] == "recipes/described" and result["template"] == "causal_lm"
    fields = {f["key"]: f for f in result["fields"]}
    assert fields["train.max_steps"] == {
        "key": "train.max_steps", "type": "int", "default": 200, "value": 7,
        "description": "Optimizer steps to train for.",
    }
    assert fields["data.seq_len"]["default"] == 256 and fields["data.seq_len"]["value"] == 64
    assert fields["checkpoint.every"]["value"] == 50  # from the template's config.yaml
    assert fields["data.source"]["type"] == "Literal['stdlib', 'files', 'random'] | None"
    assert "files: data.paths" in fields["data.source"]["description"]
    assert fields["model.pretrained_path"]["type"] == "str | None"
    (skill,) = result["skills"]
    assert skill["skill"].startswith("loss-guard") and skill["commit"] == head(workspace)
    assert json.loads(skill["params"])["max_bad_steps"] == 5
    assert result["last_commit"] == head(workspace) and result.get("cut") is None
    assert text_bytes(result) < 8 * 1024  # as the agent reads it
    # Describing a recipe leaves nothing behind (no bytecode, no run).
    assert git(workspace, "status", "--porcelain", "--ignored") == status_before


@pytest.mark.parametrize(
    "recipe_arg, expected",
    [
        ("recipes/nope", "not_found: no recipe 'recipes/nope' in the workspace"),
        (".git", "recipe '.git' is inside .git/"),
    ],
)
def test_describing_something_that_is_not_a_recipe_is_a_tool_error(client, recipe, recipe_arg, expected):
    assert expected in client.error("describe_recipe", recipe=recipe_arg)


def test_describing_a_recipe_whose_config_is_broken_names_the_key(client, workspace, recipe):
    broken = workspace / "recipes" / "broken"
    if not broken.exists():
        shutil.copytree(TEMPLATE, broken, ignore=shutil.ignore_patterns("__pycache__"))
        (broken / "config.yaml").write_text("train:\n  max_stpes: 3\n")
    message = client.error("describe_recipe", recipe="recipes/broken")
    assert "unknown config key 'train.max_stpes' (did you mean 'train.max_steps'?)" in message


def test_list_recipes_finds_recipe_folders_with_their_history(client, workspace, recipe):
    mine = workspace / "experiments" / "mine"
    if not mine.exists():
        shutil.copytree(TEMPLATE, mine, ignore=shutil.ignore_patterns("__pycache__"))
    for not_a_recipe in ("runs/20990101-000000-x-0000", ".hidden/x", "recipes/empty"):
        (workspace / not_a_recipe).mkdir(parents=True, exist_ok=True)
    (workspace / "runs/20990101-000000-x-0000/recipe.py").write_text("")
    (workspace / ".hidden/x/recipe.py").write_text("")

    result = client.ok("list_recipes")

    by_path = {r["path"]: r for r in result["recipes"]}
    assert set(by_path) == {"recipes/described", "recipes/broken", "experiments/mine"}
    assert list(by_path)[-1] == "experiments/mine"  # recipes/* first
    assert by_path["recipes/described"] == {
        "path": "recipes/described", "template": "causal_lm", "last_commit": head(workspace),
        "last_change": "skill(loss-guard): apply to recipes/described", "skills": 1, "runs": 0,
    }
    assert by_path["experiments/mine"] == {
        "path": "experiments/mine", "template": None, "last_commit": None, "last_change": None,
        "skills": 0, "runs": 0,
    }
    assert result["truncated"] is False


def test_long_descriptions_are_cut_to_keep_the_result_small_and_say_so():
    fields = [ConfigField(key=f"section.key_{i}", type="int", default=i, value=i, description="word " * 200)
              for i in range(40)]
    described = RecipeDescription(recipe="recipes/big", skills=[], fields=fields)

    fitted = _fit(described)

    assert fitted.cut is not None and "keys=" in fitted.cut  # what was cut, and how to read it whole
    assert text_bytes(fitted.model_dump(mode="json")) <= MAX_DESCRIBE_BYTES < 8 * 1024
    assert [f.key for f in fitted.fields] == [f.key for f in fields]  # every key stays
    assert all(f.description.endswith("…") or f.description == "" for f in fitted.fields)
    assert _fit(RecipeDescription(recipe="r", skills=[], fields=fields[:2])).cut is None


def test_keys_describe_a_section_whole_where_the_whole_recipe_is_cut(client, workspace):
    """The sft template's descriptions are cut to fit 8 KB; keys=[...] reads the ones asked for
    whole (the finding: ~25 characters with no way to read the rest)."""
    from engine.config import describe_fields
    from recipes_template.sft import recipe as sft

    whole = {f["key"]: f["description"] for f in describe_fields(sft.SFTConfig())}
    everything = client.ok("describe_recipe", recipe="sft")
    assert "keys=" in everything["cut"]
    shortened = [f["key"] for f in everything["fields"] if f.get("description") != whole[f["key"]]]
    assert any(key.startswith("data.") for key in shortened)

    data = client.ok("describe_recipe", recipe="sft", keys=["data", "optim.lr"])
    assert data.get("cut") is None
    assert {f["key"]: f["description"] for f in data["fields"]} == {
        key: text for key, text in whole.items() if key.startswith("data.") or key == "optim.lr"}
    error = client.error("describe_recipe", recipe="sft", keys=["data", "train.lr"])  # one unknown key
    assert "train.lr" in error and "sections are" in error and "data" in error
    assert "empty key" in client.error("describe_recipe", recipe="sft", keys=[" "])
    # A key is refused by its length before it is compared with every config key (a direct call
    # with a 100 MB key took 18 s of CPU; MCP arguments are capped at 100,000 characters anyway).
    assert "at most 200 characters" in client.error("describe_recipe", recipe="sft", keys=["a" * 1_000])


# vlm_chat has no model until the user names one: its keys are described all the same (the check
# that loads the model and reads the data is for a recipe, not for a template's description).
@pytest.mark.parametrize("template,key", [("dpo", "dpo.beta"), ("vlm_chat", "model.pretrained_path")])
def test_a_template_is_described_by_its_name_before_it_is_scaffolded(client, workspace, template, key):
    status_before = git(workspace, "status", "--porcelain", "--ignored")
    result = client.ok("describe_recipe", recipe=template)
    assert result["recipe"] == f"template {template}" and result["template"] == template
    fields = {f["key"]: f for f in result["fields"]}
    assert fields[key]["description"] and "value" not in fields[key]  # the default: not said twice
    assert not (workspace / "recipes" / template).exists()
    assert git(workspace, "status", "--porcelain", "--ignored") == status_before
    assert "no_such_template" in client.error("describe_recipe", recipe="no_such_template")


def test_an_unchanged_recipe_is_described_from_the_cache_and_callers_share_one_check(tmp_path, monkeypatch):
    """describe_recipe ran a sandboxed check per call (2.6 s alone, 56 s at 32 sessions): an
    unchanged recipe is answered from a cache keyed by its content; concurrent callers of one
    recipe share one check; a change to any file of it is checked again."""
    import threading
    import time

    from mcp_server.operations import recipe_info
    from mcp_server.operations.recipes import scaffold_recipe
    from tests.sandbox.helpers import make_workspace
    from workspace.workspace import Workspace

    ws = Workspace.open(make_workspace(tmp_path / "ws"))
    scaffold_recipe(ws, "causal_lm", "cached", {"train.max_steps": 7})
    real, calls = recipe_info.check_launch, []

    def counted(*args, **kwargs):
        calls.append(args[1])
        time.sleep(0.5)  # a check in flight while the other callers arrive
        return real(*args, **kwargs)

    monkeypatch.setattr(recipe_info, "check_launch", counted)
    monkeypatch.setattr(recipe_info, "_checked", type(recipe_info._checked)())
    results: list = []
    threads = [threading.Thread(target=lambda: results.append(recipe_info.describe_recipe(ws, "cached")))
               for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert len(results) == 6 and len(calls) == 1
    assert all(r == results[0] for r in results)
    assert recipe_info.describe_recipe(ws, "cached") == results[0] and len(calls) == 1
    config = ws.root / "recipes" / "cached" / "config.yaml"
    config.write_text(config.read_text().replace("max_steps: 7", "max_steps: 9"))
    changed = recipe_info.describe_recipe(ws, "cached")
    assert len(calls) == 2
    assert {f.key: f.value for f in changed.fields}["train.max_steps"] == 9


def test_a_recipe_with_a_link_in_it_is_checked_each_time_never_answered_stale(tmp_path, monkeypatch):
    """What a link in the recipe leads to can change while the recipe's own files do not: such
    a recipe is never answered from the cache (and nothing behind the link is read for its key)."""
    from mcp_server.operations import recipe_info
    from mcp_server.operations.recipes import scaffold_recipe
    from tests.sandbox.helpers import make_workspace
    from workspace.workspace import Workspace

    ws = Workspace.open(make_workspace(tmp_path / "ws"))
    scaffold_recipe(ws, "causal_lm", "linked", {})
    (tmp_path / "outside.py").write_text("# changed behind the recipe's back\n")
    (ws.root / "recipes" / "linked" / "extra.py").symlink_to(tmp_path / "outside.py")
    calls = []
    real = recipe_info.check_launch
    monkeypatch.setattr(recipe_info, "check_launch", lambda *a, **k: calls.append(1) or real(*a, **k))
    first = recipe_info.describe_recipe(ws, "linked")
    assert recipe_info.describe_recipe(ws, "linked") == first and len(calls) == 2


def test_callers_beyond_the_check_slots_wait_in_the_order_they_came_and_hear_how_far_they_are(monkeypatch):
    import threading
    import time

    from mcp_server.operations import recipe_info

    monkeypatch.setattr(recipe_info, "WAIT_NOTE_EVERY_S", 0.05)
    slots, order, notes = recipe_info.FifoSlots(1), [], {i: [] for i in range(4)}
    release = threading.Event()

    def caller(i: int) -> None:
        with slots.held(notes[i].append):
            order.append(i)
            if i == 0:
                release.wait(10)

    threads = []
    for i in range(4):  # 0 holds the slot; 1, 2, 3 queue in that order
        threads.append(threading.Thread(target=caller, args=(i,)))
        threads[-1].start()
        time.sleep(0.2)
    release.set()
    for thread in threads:
        thread.join(10)
    assert order == [0, 1, 2, 3]
    assert notes[0] == [] and notes[3]  # the holder waited for nothing
    assert "3 ahead" in notes[3][0] and "at most 1 run at once" in notes[3][0]
    assert slots.holders == 0 and not slots.queue


def test_a_described_recipe_waiting_for_a_check_sends_progress_to_the_mcp_caller(tmp_path, monkeypatch):
    """A caller past MAX_CONCURRENT_CHECKS (here the one slot is held) waits, and is told so in
    progress notifications, not left silent until the answer."""
    import threading

    from mcp_server.operations import recipe_info
    from tests.mcp.conftest import connect
    from tests.sandbox.helpers import make_workspace

    monkeypatch.setattr(recipe_info, "WAIT_NOTE_EVERY_S", 0.05)
    monkeypatch.setattr(recipe_info, "check_slots", recipe_info.FifoSlots(1))
    busy, release = threading.Event(), threading.Event()

    def hold_the_slot() -> None:
        with recipe_info.check_slots.held():
            busy.set()
            release.wait(30)

    blocker = threading.Thread(target=hold_the_slot)
    blocker.start()
    busy.wait(10)
    threading.Timer(1.0, release.set).start()
    try:
        with connect("memory", make_workspace(tmp_path / "ws")) as client:
            progress: list = []
            assert client.ok("describe_recipe", progress, recipe="dpo")["fields"]
    finally:
        release.set()
        blocker.join(10)
    waits = [p for p in progress if "waiting for a config check: 1 ahead" in (p[2] or "")]
    assert waits, progress
    values = [p[0] for p in progress]
    assert values == sorted(values) and len(set(values)) == len(values)  # each one higher, as MCP requires
