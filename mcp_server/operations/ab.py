"""``trainwright ab SKILL RECIPE --steps N``: a skill's effect as a measured verdict.

A run executes a snapshot of the recipe at a commit (:mod:`runner.provenance`), and
``apply_skill`` writes a skill as one commit of its own. So the skill's effect is the difference
between two commits of the same recipe: **b**, the skill's commit (the newest commit of the
recipe whose ``Skill-Applied`` trailer names the skill), and **a**, its parent, the code just
before it. Nothing else differs: both run with the same config, seed and steps, from the
commits' own files (``launch_run(commit=...)``), so uncommitted changes and later commits are in
neither (said so in ``remarks``). A skill that is not applied yet is refused with the command
that applies it: an A/B measures a change the user made, it does not make one (the skill may
need ``params`` or a ``target``, and its diff is for the user to read first). Instead of a skill,
any two revisions can be measured (``--b REV``, and ``--a REV`` or b's parent).

The user's own training script is measured the same way (a skill applied to it, or two
revisions): both sides run the script as each commit holds it (``launch_run(commit=...)``),
with the same command line (``args``), which says how long it runs; a script has no config to
set, so ``--steps`` and ``--set`` are for recipes.

The runs go one at a time, interleaved round by round: a b, then b a, then a b… (R rounds, 2 by
default: a b b a), so a load that rises or falls over the A/B falls on both sides alike. The
verdict is :func:`~mcp_server.operations.compare.compare_groups` over all rounds: speed windows
pooled per side, so the noise bound holds the load's changes between rounds, rather than a vote
of per-round verdicts, which has no noise bound of its own. Each round's own pair
(``compare_runs``) is kept beside it, to show whether the rounds agree. With ``note``, the verdict
(a line per metric, and the command) is appended to the skill commit's git note.
"""

from __future__ import annotations

import json
import shlex
import time
from typing import Any, Callable, Literal

import skills as skill_library
from engine import run_dir as rd
from engine import run_metrics
from engine.config import Overrides
from engine.errors import BadInput
from mcp_server.arguments import LaunchRunArgs
from mcp_server.limits import AB_DEFAULT_ROUNDS, AB_MAX_ROUNDS, AB_MAX_STEPS, AB_MIN_STEPS, POLL_S
from mcp_server.models import AbResult, AbRound, AbRun, MetricVerdict
from mcp_server.operations import compare
from mcp_server.operations import launch as launching
from mcp_server.operations import runs as run_ops
from runner import scripts
from workspace import git as workspace_git
from workspace.paths import check_name
from workspace.workspace import RunSource, Workspace

DEFAULT_ROUNDS, MAX_ROUNDS, MIN_STEPS, MAX_STEPS = AB_DEFAULT_ROUNDS, AB_MAX_ROUNDS, AB_MIN_STEPS, AB_MAX_STEPS
WINDOWS = 10  # logging windows per run, unless train.log_every is set
PROGRESS_EVERY_S = 5.0

Progress = Callable[[str], None]


def ab(
    ws: Workspace,
    skill: str | None,
    recipe: str,
    steps: int | None,
    rounds: int = DEFAULT_ROUNDS,
    overrides: Overrides = None,
    nproc: int = 1,
    note: bool = False,
    progress: Progress | None = None,
    args: list[str] | None = None,
    revisions: tuple[str | None, str | None] = (None, None),
) -> AbResult:
    """Run the recipe or script without and with ``skill`` (its commit's parent, then its
    commit), or at two ``revisions`` (a, b; a None a is b's parent), interleaved over
    ``rounds``, and compare. A recipe's runs are ``steps`` long; a script's are what its ``args``
    say. What the A/B itself takes (skill, code, steps, rounds, the overrides' form, the commits)
    is checked before the first run, and a recipe's first launch check refuses a bad config key
    before anything is written."""
    say = progress or (lambda _: None)
    if (skill is None) == (revisions[1] is None):
        raise BadInput("an A/B measures a skill's commit against its parent (SKILL) or two revisions (--b REV, "
                       "with --a REV or b's parent): give one of them")
    if skill is not None:
        check_name(skill, "skill")
        skill_library.get_skill(skill)  # an unknown skill is not_found, with the valid names
    elif note:
        raise BadInput("--note writes the verdict into a skill commit's note: give the skill")
    rounds = _bounded("rounds", rounds, 1, MAX_ROUNDS)
    source = ws.run_source(recipe)
    code = source.code
    label = ws.label(code)
    config, given, args, steps = _settings(ws, source, steps, overrides, args)
    LaunchRunArgs.checked(recipe=label, nproc=nproc)  # as launch_run checks it, before the first run
    repo = workspace_git.open_repo(ws.root)
    if repo is None:
        raise workspace_git.GitRefused("the workspace is not a git repository: an A/B runs two commits of the code")
    applied, commit_a, commit_b, later = _commits(repo, source, skill, revisions, label)
    remarks = []
    if later:
        remarks.append(f"{later} later commit(s) of {label} are in neither run: b is {applied}'s own commit")
    if workspace_git.uncommitted(repo, code):
        remarks.append(f"the uncommitted changes in {label} are in neither run: each runs a commit's files")
    command = _command(skill, label, steps, rounds, given, nproc, note, args, revisions)
    commits = {"a": commit_a, "b": commit_b}
    say(f"A/B of {applied or 'two commits'} on {label}: a = {commit_a[:10]}, b = {commit_b[:10]}; "
        f"{rounds} round(s) of {run_length(steps, args)}, order {' '.join(s for r in range(rounds) for s in _order(r))}")

    runs, per_round, outcome, error = _run_rounds(ws, label, nproc, config, args, commits, rounds, steps, say)
    result = AbResult(skill=applied, recipe=label, commit_a=commit_a, commit_b=commit_b, steps=steps, args=args,
                      rounds=rounds, command=command, runs=runs, per_round=per_round, differences=[], verdict=[],
                      left_out=[], remarks=remarks, outcome=outcome, error=error)
    return _verdict(ws, result, note) if per_round else result


def _settings(ws: Workspace, source: RunSource, steps: int | None, overrides: Overrides, args: list[str] | None
              ) -> tuple[dict[str, Any] | None, dict[str, Any], list[str] | None, int | None]:
    """What every run of the A/B is launched with: a recipe's config (``steps`` long, logged
    ten times, no checkpoints; and the overrides as given), or a script's command line (its
    own steps and logging)."""
    if source.script is not None:
        if steps is not None or overrides:
            raise BadInput("a script's steps and settings are its own command line: give them as args (after -- on "
                           "the command line); --steps and --set are for recipes")
        return None, {}, scripts.check_args(args), None
    if args:
        raise BadInput("args are a script's command line; a recipe's runs are set with --steps and --set")
    if steps is None:
        raise BadInput("--steps is required for a recipe: it sets train.max_steps of every run of the A/B")
    steps = _bounded("steps", steps, MIN_STEPS, MAX_STEPS)
    given = launching.checked_overrides(ws, overrides)
    if "train.max_steps" in given:
        raise BadInput("--steps sets train.max_steps of every run of the A/B: leave it out of the overrides")
    config = {"train.log_every": max(1, steps // WINDOWS), "checkpoint.every": 0, "checkpoint.at_end": False,
              **given, "train.max_steps": steps}
    return config, given, None, steps


def _verdict(ws: Workspace, result: AbResult, note: bool) -> AbResult:
    """``result`` with the rounds compared as two groups (b against a); with ``note``, a
    completed A/B's verdict appended to the skill commit's note."""
    pooled = compare.compare_groups(ws, [r.run_a for r in result.per_round], [r.run_b for r in result.per_round])
    result = result.model_copy(update={"differences": pooled.differences, "verdict": pooled.metrics,
                                       "left_out": pooled.left_out})
    if note and result.outcome == "completed":
        written = workspace_git.add_note(ws.root, result.commit_b, note_text(result))
        result = result.model_copy(update={"note_written": written})
        if not written:
            result.remarks.append(f"the note on {result.commit_b[:10]} could not be written (git refused or its "
                                  "lock was held)")
    return result


def _run_rounds(ws: Workspace, label: str, nproc: int, config: dict[str, Any] | None, args: list[str] | None,
                commits: dict[str, str], rounds: int, steps: int | None, say: Progress,
                ) -> tuple[list[AbRun], list[AbRound], Literal["completed", "failed", "stopped"], str | None]:
    """The runs, one at a time in the order of :func:`_order`, each round compared when it ends;
    the first run that does not complete ends the A/B (its outcome and error). A recipe's runs
    take ``config``, a script's ``args``."""
    runs: list[AbRun] = []
    per_round: list[AbRound] = []
    for index in range(rounds):
        for side in _order(index):
            launched = launching.launch_run(ws, label, nproc, config, args=args, commit=commits[side])
            say(f"round {index + 1}/{rounds} {side}: run {launched.run_id} ({launched.code})")
            status = _wait(ws, launched.run_id, steps, say)
            runs.append(AbRun(round=index + 1, side=side, run_id=launched.run_id, status=status))
            if status != rd.COMPLETED:
                info = run_ops.get_run(ws, launched.run_id)
                error = f"run {launched.run_id} ({side}) {status}" + (f": {info.error}" if info.error else "")
                return runs, per_round, "stopped" if status == rd.STOPPED else "failed", error
        run_a, run_b = (next(r.run_id for r in runs if r.round == index + 1 and r.side == side) for side in "ab")
        per_round.append(AbRound(round=index + 1, run_a=run_a, run_b=run_b,
                                 metrics=compare.compare_runs(ws, run_a, run_b).metrics))
        say(f"round {index + 1}: " + "; ".join(_short(m) for m in per_round[-1].metrics))
    return runs, per_round, "completed", None


def note_text(result: AbResult) -> str:
    """The verdict as the skill commit's note: a line per metric, then the command."""
    head = (f"A/B of {result.skill}: this commit (b) against {result.commit_a[:10]} (a, before it), "
            f"{result.rounds} round(s) of {run_length(result.steps, result.args)}, interleaved")
    return "\n".join([head, *(f"  {_short(m)}" for m in result.verdict), f"  command: {result.command}"])


def _short(m: MetricVerdict) -> str:
    """One metric's verdict in a line: the verdict, the ratio, the two figures."""
    text = f"{m.metric} {m.verdict}"
    if m.ratio is not None:
        text += f" ×{m.ratio:.3g}"
    if m.a is not None and m.b is not None:
        text += f" ({m.a:,.5g} → {m.b:,.5g})"
    if m.evidence.startswith("bit-equal"):
        text += " bit-equal"
    return text


def _commits(repo: Any, source: RunSource, skill: str | None, revisions: tuple[str | None, str | None],
             label: str) -> tuple[str | None, str, str, int]:
    """The skill as applied (None for two revisions), the commit of a, the commit of b, and how
    many later commits changed the code (after the skill's); each commit holds the code."""
    if skill is not None:
        applied, commit_b, later = _skill_commit(repo, source.code, skill, label)
        parents = repo.commit(commit_b).parents
        if not parents or not _holds(repo, parents[0].hexsha, source):
            raise BadInput(f"{applied} was applied in the first commit of {label} ({commit_b[:10]}): no commit holds "
                           "the code without it")
        return applied, parents[0].hexsha, commit_b, later
    given_a, given_b = revisions
    commit_b = workspace_git.resolve_commit(repo, given_b)
    parents = repo.commit(commit_b).parents
    if given_a is None and not parents:
        raise BadInput(f"--b {given_b} is the first commit: it has no parent to be a; give --a REV")
    commit_a = workspace_git.resolve_commit(repo, given_a) if given_a is not None else parents[0].hexsha
    for side, sha in (("a", commit_a), ("b", commit_b)):
        if not _holds(repo, sha, source):
            raise BadInput(f"commit {sha[:10]} ({side}) does not hold {label}: `git log -- {label}` lists the "
                           "commits that do")
    return None, commit_a, commit_b, 0


def _holds(repo: Any, sha: str, source: RunSource) -> bool:
    """Whether commit ``sha`` holds the code ``source`` runs: its recipe.py, or its script."""
    if source.alone and source.script:
        return workspace_git.tree_file(repo, sha, source.code) is not None
    files = workspace_git.tree_files(repo, sha, source.code_dir)
    return files is not None and any(f.path == (source.script or "recipe.py") for f in files)


def _skill_commit(repo: Any, code: Any, skill: str, label: str) -> tuple[str, str, int]:
    """The skill's trailer value (name@version), its newest commit of the code, and how many
    commits of the code came after it."""
    for later, commit in enumerate(workspace_git.path_commits(repo, code)):
        for key, value in commit.trailers:
            if key == workspace_git.SKILL_APPLIED_TRAILER and workspace_git.applied_skill_name(value) == skill:
                return value, commit.sha, later
    raise BadInput(f"{skill} is not applied to {label} (no commit of it has a {workspace_git.SKILL_APPLIED_TRAILER}: {skill} trailer), so no "
                   f"commit holds its change to measure; apply it first (`trainwright apply {skill} {label}`, or "
                   "apply_skill), then run the A/B")


def _order(index: int) -> tuple[str, str]:
    return ("a", "b") if index % 2 == 0 else ("b", "a")


def _wait(ws: Workspace, run_id: str, steps: int | None, say: Progress) -> str:
    """The run's final status, once it ended; a line on the way now and then; Ctrl-C stops it."""
    run_dir = ws.run_dir(run_id)
    last_said, last_step = time.monotonic(), None
    try:
        while True:
            _, record = run_ops.known_run(ws, run_id)
            if record.effective_status() in rd.FINAL_STATUSES and not record.supervisor_alive():
                return run_ops.get_run(ws, run_id).status
            step = (run_metrics.latest_metrics(run_dir / rd.METRICS_JSONL) or {}).get("step")
            if step != last_step and time.monotonic() - last_said >= PROGRESS_EVERY_S:
                say(f"  {run_id}: step {step}" + (f"/{steps}" if steps else ""))
                last_said, last_step = time.monotonic(), step
            time.sleep(POLL_S)
    except KeyboardInterrupt:
        say(f"stopping run {run_id}…")
        run_ops.stop_run(ws, run_id)
        raise


def _bounded(name: str, value: object, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadInput(f"{name} must be an integer, got {value!r}")
    if not low <= value <= high:
        why = ""
        if name == "steps" and 0 < value < low:
            why = " (the first logging window is the warm-up; a speed verdict needs two after it)"
        elif value > high:
            why = " (an A/B is short; for longer runs use launch_run with commit, then compare_runs)"
        raise BadInput(f"{name} must be between {low} and {high}, got {value}{why}")
    return value


def run_length(steps: int | None, args: list[str] | None) -> str:
    """How long each run is: a recipe's steps, or the script's command line that says it."""
    return f"{steps} steps" if steps is not None else f"args {shlex.join(args or [])!r}"


def _command(skill: str | None, label: str, steps: int | None, rounds: int, given: dict[str, Any], nproc: int,
             note: bool, args: list[str] | None, revisions: tuple[str | None, str | None]) -> str:
    """The command line that runs the same A/B again."""
    parts = ["trainwright", "ab", *([skill] if skill else []), label]
    if skill is None:
        given_a, given_b = revisions
        parts += ["--b", shlex.quote(str(given_b)), *(["--a", shlex.quote(given_a)] if given_a is not None else [])]
    if steps is not None:
        parts += ["--steps", str(steps)]
    parts += ["--rounds", str(rounds)]
    if nproc != 1:
        parts += ["--nproc", str(nproc)]
    parts += [f"--set {key}={value if isinstance(value, str) else json.dumps(value)}" for key, value in given.items()]
    parts += ["--note"] if note else []
    return " ".join(parts + (["--", shlex.join(args)] if args else []))
