"""What a recipe is: its config keys (``describe_recipe``) and the workspace's recipes
(``list_recipes``).

The config schema lives in the recipe's code, so only the engine can read it: the description
comes from the engine's own launch check (``python -m engine.launch RECIPE --check``, run
sandboxed like every check), never from an import here. The history — the template a recipe
came from, the skills applied to it — comes from the trailers of the commits that touch it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import sys
import threading
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future  # its result(timeout) raises TimeoutError (3.11)
from pathlib import Path

from runner import server_record as sr
from engine.errors import BadInput, NotFound
from mcp_server.limits import AGENT_BUDGET_CHARS, MAX_CONCURRENT_CHECKS, bounded, json_chars, text_bytes
from mcp_server.models import (
    RecipeDescription,
    RecipeList,
    RecipeSkill,
    RecipeSummary,
    hub_model_shown,
)
from workspace import git as workspace_git
from workspace.paths import RESERVED_DIRS
from runner import hub
from runner.lifecycle import check_launch
from runner.scripts import DOCS_PAGE
from workspace.workspace import Workspace

# The result as an agent reads it (indented JSON, larger than the compact form the budget counts).
MAX_DESCRIBE_BYTES = AGENT_BUDGET_CHARS
DESCRIPTION_LIMITS = (160, 80, 60, 40, 30, 20, 0)  # characters kept per description, tried in turn
MAX_SKILLS_SHOWN = 50
MAX_RECIPES = 100
MAX_SUMMARY_FIELD_CHARS = 200  # a folder name, a commit subject
MAX_SEARCH_DEPTH = 4
MAX_FOLDERS_SEARCHED = 5_000
MAX_RUNS_COUNTED = 10_000
SKIPPED_FOLDERS = frozenset({"__pycache__", "node_modules", "site-packages"})


def _history(ws: Workspace, recipe_dir: Path) -> tuple[str | None, str | None, str | None, list[RecipeSkill]]:
    """(template, last commit, its subject, skills applied oldest first) from the git history."""
    repo = workspace_git.open_repo(ws.root)
    if repo is None:
        return None, None, None, []
    commits = workspace_git.path_commits(repo, recipe_dir)
    template, skills = None, []
    for commit in reversed(commits):  # oldest first
        trailers = dict(commit.trailers)
        template = trailers.get(workspace_git.SCAFFOLDED_FROM_TRAILER, template)
        if workspace_git.SKILL_APPLIED_TRAILER in trailers:
            skills.append(RecipeSkill(skill=trailers[workspace_git.SKILL_APPLIED_TRAILER],
                                      params=trailers.get(workspace_git.SKILL_PARAMS_TRAILER),
                                      commit=commit.sha))
    if not commits:
        return template, None, None, skills
    return template, commits[0].sha, commits[0].subject, skills


def describe_recipe(ws: Workspace, recipe: str, keys: list[str] | None = None,
                    waiting: Callable[[str], None] | None = None) -> RecipeDescription:
    """Every config key of a recipe (from the engine's check), its template and skills; a
    template's name (no recipe of that name in the workspace) describes the template, before a
    recipe is scaffolded from it. ``keys``: only the keys equal to one of them or under it
    (``train`` is every ``train.*`` key), so a description cut to fit reads whole."""
    prefixes = _key_prefixes(keys)
    try:
        recipe_dir = ws.recipe(recipe)
    except NotFound:
        source = _template(recipe)
        if source is None:
            _refuse_a_script(ws, recipe)
            raise
        fields = _selected(checked_fields(ws.root, source, ws.run_limits(), None, waiting, keys_only=True), prefixes)
        return _fit(RecipeDescription(recipe=f"template {recipe}", template=recipe, skills=[], fields=fields))
    limits = ws.run_limits()
    models = hub.bind(ws.root, hub.recipe_config(recipe_dir, {}),
                      dataset=hub.recipe_config(recipe_dir, {}, hub.DATASET_KEY), allow_pickled=limits.allow_pickled_weights,
                      remote_code=limits.trust_remote_code)
    fields = _selected(checked_fields(ws.root, recipe_dir, limits, models, waiting), prefixes)
    template, last_commit, _, skills = _history(ws, recipe_dir)
    described = RecipeDescription(
        recipe=ws.label(recipe_dir), template=template, last_commit=last_commit,
        hub_models=[hub_model_shown(m) for m in models.models],
        skills=skills[-MAX_SKILLS_SHOWN:], fields=fields,
        cut=f"the first {len(skills) - MAX_SKILLS_SHOWN} skills applied (list_recipes counts them)"
        if len(skills) > MAX_SKILLS_SHOWN else None,
    )
    return _fit(described)


# The launch check costs a sandboxed process that imports torch (~2.6 s alone); a recipe that has
# not changed has the same config keys. So the keys are kept by a digest of everything the check
# reads (the recipe folder's files, the engine's code, the trusted limits, the bound Hub models,
# the interpreter), at most MAX_CACHED_CHECKS of them; callers of one recipe share one check in
# flight, and at most MAX_CONCURRENT_CHECKS checks run at once (more callers wait, in turn).
MAX_CACHED_CHECKS = 64
MAX_HASHED_FILES, MAX_HASHED_BYTES = 500, 20 * 2**20
_checked: OrderedDict[str, list] = OrderedDict()
_in_flight: dict[str, Future] = {}
_checked_lock = threading.Lock()
WAIT_NOTE_EVERY_S = 1.0  # a waiting caller hears how far it is, this often


class FifoSlots:
    """At most ``size`` holders at once; the others wait in the order they came, each told every
    WAIT_NOTE_EVERY_S how many are ahead of it (``waiting``, called without the lock held)."""

    def __init__(self, size: int):
        self.size, self.holders = size, 0
        self.queue: deque[object] = deque()
        self.changed = threading.Condition()

    @contextlib.contextmanager
    def held(self, waiting: Callable[[str], None] | None = None):
        me = object()
        with self.changed:
            self.queue.append(me)
        try:
            while True:
                with self.changed:
                    if not self._mine(me):
                        self.changed.wait(WAIT_NOTE_EVERY_S)
                    if self._mine(me):
                        self.queue.popleft()
                        self.holders += 1
                        break
                    ahead = self.queue.index(me) + self.holders
                if waiting is not None:
                    waiting(f"waiting for a config check: {ahead} ahead (at most {self.size} run at once)")
        except BaseException:
            with self.changed:
                self.queue.remove(me)
                self.changed.notify_all()
            raise
        try:
            yield
        finally:
            with self.changed:
                self.holders -= 1
                self.changed.notify_all()

    def _mine(self, me: object) -> bool:
        return self.holders < self.size and self.queue[0] is me


check_slots = FifoSlots(MAX_CONCURRENT_CHECKS)


def checked_fields(workspace: Path, folder: Path, limits, models,
                   waiting: Callable[[str], None] | None = None, keys_only: bool = False) -> list:
    """The config keys of the recipe (or template) in ``folder``, from the launch check or the
    cache of an unchanged one; ``waiting`` hears, while the caller waits for a check, how far it is.
    ``keys_only``: a template's keys, its config not checked against a model or data it does not
    name yet (vlm_chat's model is the user's)."""
    key = _check_key(folder, limits, models, keys_only)
    bound: dict = {"models": models} if models is not None else {}
    bound["keys_only"] = keys_only
    if key is None:  # too large to hash: checked each time
        with check_slots.held(waiting):
            return check_launch(workspace, folder, 1, [], limits=limits, **bound).fields
    with _checked_lock:
        if key in _checked:
            _checked.move_to_end(key)
            return _checked[key]
        future = _in_flight.get(key)
        owner = future is None
        if owner:
            future = _in_flight[key] = Future()
    assert future is not None
    if not owner:
        while True:
            try:
                return future.result(timeout=WAIT_NOTE_EVERY_S)
            except TimeoutError:
                if waiting is not None:
                    waiting("waiting for the check of this recipe that another call started")
    try:
        with check_slots.held(waiting):
            fields = check_launch(workspace, folder, 1, [], limits=limits, **bound).fields
        with _checked_lock:
            _checked[key] = fields
            while len(_checked) > MAX_CACHED_CHECKS:
                _checked.popitem(last=False)
        future.set_result(fields)
        return fields
    except BaseException as e:
        future.set_exception(e)
        raise
    finally:
        with _checked_lock:
            _in_flight.pop(key, None)


def _check_key(folder: Path, limits, models, keys_only: bool) -> str | None:
    """A digest of what the launch check of ``folder`` depends on, or None: a folder too large to
    hash, or one with a link in it (what it leads to may change unseen)."""
    digest, total = hashlib.sha256(), 0
    for count, path in enumerate(_bounded_tree(Path(folder), MAX_HASHED_FILES + 1)):
        if count >= MAX_HASHED_FILES or path.is_symlink():
            return None
        if "__pycache__" in path.parts or not path.is_file():
            continue
        try:
            total += path.stat().st_size
            if total > MAX_HASHED_BYTES:
                return None
            data = path.read_bytes()
        except OSError:
            return None
        digest.update(f"{path.relative_to(folder).as_posix()}\0{len(data)}\0".encode() + data)
    digest.update(_engine_code_digest().encode())
    digest.update(json.dumps(dataclasses.asdict(limits), sort_keys=True, default=str).encode())
    bound = [m.model_dump(mode="json") for m in models.models] if models is not None else []
    digest.update(json.dumps([bound, keys_only], sort_keys=True, default=str).encode())
    return digest.hexdigest()


def _bounded_tree(folder: Path, limit: int) -> list[Path]:
    """The paths under ``folder``, sorted, or the first ``limit`` found (then it is too large to
    hash anyway): never a listing of everything in a folder an agent filled."""
    found: list[Path] = []
    for root, dirs, files in os.walk(folder):  # links to folders are listed, not followed
        found += [Path(root) / name for name in dirs + files]
        if len(found) >= limit:
            return found[:limit]
    return sorted(found)


@functools.cache
def _engine_code_digest() -> str:
    """The engine's code and the interpreter that runs the check (read once per server)."""
    code = hashlib.sha256(sys.executable.encode())
    for path in sorted(Path(sr.__file__).parent.rglob("*.py")):
        code.update(path.read_bytes())
    return code.hexdigest()


def _refuse_a_script(ws: Workspace, recipe: str) -> None:
    """A training script has no config keys to describe: say so, and what runs it."""
    try:
        source = ws.run_source(recipe)
    except (BadInput, NotFound):
        return
    if source.script is not None:
        raise BadInput(f"{recipe!r} is a training script, not a recipe: it has no config keys to describe. "
                       f"launch_run runs it as it is (args: its command line); {DOCS_PAGE} says what a recipe "
                       "adds (bit-exact resume, FSDP2 by the engine, export, sample, evaluate)")


def _template(name: str) -> Path | None:
    """The folder of the template ``name``, or None when there is none of that name."""
    from mcp_server.operations.recipes import template_dir

    try:
        return template_dir(name)
    except (BadInput, NotFound):  # no template of that name, or not a plain name
        return None


def _key_prefixes(keys: list[str] | None) -> tuple[str, ...]:
    """The keys asked for (as :class:`~mcp_server.arguments.DescribeArgs` checked them), each as
    a dotted prefix."""
    return tuple(k.strip().strip(".") for k in keys or ())


def _selected(fields: list, prefixes: tuple[str, ...]) -> list:
    if not prefixes:
        return fields
    def under(key: str, prefix: str) -> bool:
        return key == prefix or key.startswith(prefix + ".")

    unknown = [p for p in prefixes if not any(under(f.key, p) for f in fields)]
    if unknown:
        known = sorted({f.key.split(".")[0] for f in fields})
        raise BadInput(f"keys: no config key is or starts with {', '.join(unknown)[:200]}; "
                       f"the sections are {', '.join(known)}")
    return [f for f in fields if any(under(f.key, p) for p in prefixes)]


def _fit(described: RecipeDescription) -> RecipeDescription:
    """Cut descriptions (then, if need be, the last fields) until the result fits the budget."""
    if text_bytes(described.model_dump(mode="json")) <= MAX_DESCRIBE_BYTES:
        return described
    fields = described.fields
    earlier = f"{described.cut}; " if described.cut else ""
    for limit in DESCRIPTION_LIMITS:
        fields = [f.model_copy(update={"description": _cut(f.description, limit)}) for f in described.fields]
        cut = (f"{earlier}descriptions cut to {limit} characters" if limit else f"{earlier}descriptions left out")
        candidate = described.model_copy(update={"fields": fields, "cut": f"{cut}; {READ_WHOLE}"})
        if text_bytes(candidate.model_dump(mode="json")) <= MAX_DESCRIBE_BYTES:
            return candidate
    total = len(fields)
    while fields and text_bytes(candidate.model_dump(mode="json")) > MAX_DESCRIBE_BYTES:
        fields = fields[:-1]
        candidate = candidate.model_copy(update={
            "fields": fields, "cut": f"{earlier}descriptions left out, the last {total - len(fields)} keys too; {READ_WHOLE}"})
    return candidate


READ_WHOLE = "keys=[a section or key, e.g. \"train\"] describes those keys whole"


def _cut(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return text[: limit - 1] + "…" if limit else ""


# ---------------------------------------------------------------------------------------------
# list_recipes
# ---------------------------------------------------------------------------------------------


def find_recipes(ws: Workspace) -> tuple[list[Path], bool]:
    """Recipe folders (with a recipe.py): ``recipes/*`` first, then any other folder of the
    workspace outside runs/, .git/, .trainwright/ and hidden folders, a few levels deep."""
    found: list[Path] = []
    if ws.recipes_dir.is_dir() and not ws.recipes_dir.is_symlink():
        found = sorted(p for p in ws.recipes_dir.iterdir()
                       if p.is_dir() and not p.is_symlink() and (p / "recipe.py").is_file())
    seen = set(found)
    searched = 0
    for folder, subfolders, files in os.walk(ws.root):
        here = Path(folder)
        depth = len(here.relative_to(ws.root).parts)
        subfolders[:] = sorted(
            name for name in subfolders
            if not name.startswith(".") and name not in SKIPPED_FOLDERS
            and not (depth == 0 and name in RESERVED_DIRS)
            and not (here / name).is_symlink() and depth < MAX_SEARCH_DEPTH
        )
        searched += 1
        if "recipe.py" in files and here != ws.root:
            if here not in seen:
                found.append(here)
                seen.add(here)
            subfolders[:] = []  # a recipe's own subfolders are its helpers
        if searched >= MAX_FOLDERS_SEARCHED or len(found) > MAX_RECIPES:
            break
    return found[:MAX_RECIPES], len(found) > MAX_RECIPES or searched >= MAX_FOLDERS_SEARCHED


def _runs_per_recipe(ws: Workspace) -> Counter:
    counts: Counter = Counter()
    for run_id in ws.run_ids()[:MAX_RUNS_COUNTED]:
        try:
            counts[sr.known_run(ws.root, ws.runs_dir / run_id).recipe] += 1
        except (OSError, ValueError):
            continue
    return counts


def list_recipes(ws: Workspace) -> RecipeList:
    folders, truncated = find_recipes(ws)
    runs = _runs_per_recipe(ws)
    summaries: list[RecipeSummary] = []
    budget = AGENT_BUDGET_CHARS - 200
    for folder in folders:
        template, last_commit, last_change, skills = _history(ws, folder)
        label = ws.label(folder)
        summary = RecipeSummary(
            path=_short(label), template=_short(template), last_commit=last_commit, last_change=_short(last_change),
            skills=len(skills), runs=runs[label],
        )
        budget -= json_chars(summary.model_dump(mode="json")) + 1
        if budget < 0:  # the call takes no limit: keep the first recipes that fit
            truncated = True
            break
        summaries.append(summary)
    return RecipeList(recipes=summaries, truncated=truncated)


def _short(text: str | None) -> str | None:
    return bounded(text, MAX_SUMMARY_FIELD_CHARS)[0] if text else text
