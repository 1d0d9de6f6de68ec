"""``trainwright ab SKILL RECIPE --steps N``: a skill's effect as a measured verdict.

A run executes a snapshot of the recipe at a commit (:mod:`runner.provenance`), and
``apply_skill`` writes a skill as one commit of its own. So the skill's effect is the difference
between two commits of the same recipe: **b**, the skill's commit (the newest commit of the
recipe whose ``Skill-Applied`` trailer names the skill), and **a**, its parent, the code just
before it. Nothing else differs: both run with the same config, seed and steps, from the
commits' own files (``launch_run(commit=...)``), so uncommitted changes and later commits are in
neither (said so in ``remarks``). A skill that is not applied yet is refused with the command
that applies it: an A/B measures a change the user made, it does not make one (the skill may
need ``params`` or a ``target``, and its diff is for the user to read first).

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
from workspace import git as workspace_git
from workspace.paths import check_name
from workspace.workspace import Workspace

DEFAULT_ROUNDS, MAX_ROUNDS, MIN_STEPS, MAX_STEPS = AB_DEFAULT_ROUNDS, AB_MAX_ROUNDS, AB_MIN_STEPS, AB_MAX_STEPS
WINDOWS = 10  # logging windows per run, unless train.log_every is set
PROGRESS_EVERY_S = 5.0

Progress = Callable[[str], None]


def ab(
    ws: Workspace,
    skill: str,
    recipe: str,
    steps: int,
    rounds: int = DEFAULT_ROUNDS,
    overrides: Overrides = None,
    nproc: int = 1,
    note: bool = False,
    progress: Progress | None = None,
) -> AbResult:
    """Run the recipe without and with ``skill`` (its commit's parent, then its commit),
    interleaved over ``rounds``, and compare. What the A/B itself takes (skill, recipe, steps,
    rounds, the overrides' form, the commits) is checked before the first run, and the first
    run's launch check refuses a bad config key before anything is written."""
    say = progress or (lambda _: None)
    check_name(skill, "skill")
    skill_library.get_skill(skill)  # an unknown skill is not_found, with the valid names
    steps, rounds = _bounded("steps", steps, MIN_STEPS, MAX_STEPS), _bounded("rounds", rounds, 1, MAX_ROUNDS)
    recipe_dir = ws.recipe(recipe)
    label = ws.label(recipe_dir)
    given = launching.checked_overrides(ws, overrides)
    if "train.max_steps" in given:
        raise BadInput("--steps sets train.max_steps of every run of the A/B: leave it out of the overrides")
    LaunchRunArgs.checked(recipe=label, nproc=nproc)  # as launch_run checks it, before the first run
    repo = workspace_git.open_repo(ws.root)
    if repo is None:
        raise workspace_git.GitRefused("the workspace is not a git repository: an A/B runs a skill's commit and the "
                                     "commit before it")
    applied, commit_a, commit_b, later = _commits(repo, recipe_dir, skill, label)
    config = {"train.log_every": max(1, steps // WINDOWS), "checkpoint.every": 0, "checkpoint.at_end": False,
              **given, "train.max_steps": steps}
    remarks = []
    if later:
        remarks.append(f"{later} later commit(s) of {label} are in neither run: b is {applied}'s own commit")
    if workspace_git.uncommitted(repo, recipe_dir):
        remarks.append(f"the uncommitted changes in {label} are in neither run: each runs a commit's files")
    command = _command(skill, label, steps, rounds, given, nproc, note)
    commits = {"a": commit_a, "b": commit_b}
    say(f"A/B of {applied} on {label}: a = {commit_a[:10]} (before it), b = {commit_b[:10]} (its commit); "
        f"{rounds} round(s) of {steps} steps, order {' '.join(s for r in range(rounds) for s in _order(r))}")

    runs, per_round, outcome, error = _run_rounds(ws, label, nproc, config, commits, rounds, steps, say)
    result = AbResult(skill=applied, recipe=label, commit_a=commit_a, commit_b=commit_b, steps=steps, rounds=rounds,
                      command=command, runs=runs, per_round=per_round, differences=[], verdict=[], left_out=[],
                      remarks=remarks, outcome=outcome, error=error)
    return _verdict(ws, result, note) if per_round else result


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


def _run_rounds(ws: Workspace, label: str, nproc: int, config: dict[str, Any], commits: dict[str, str], rounds: int,
                steps: int, say: Progress) -> tuple[list[AbRun], list[AbRound], Literal["completed", "failed", "stopped"],
                                                   str | None]:
    """The runs, one at a time in the order of :func:`_order`, each round compared when it ends;
    the first run that does not complete ends the A/B (its outcome and error)."""
    runs: list[AbRun] = []
    per_round: list[AbRound] = []
    for index in range(rounds):
        for side in _order(index):
            launched = launching.launch_run(ws, label, nproc, config, commit=commits[side])
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
            f"{result.rounds} round(s) of {result.steps} steps, interleaved")
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


def _commits(repo: Any, recipe_dir: Any, skill: str, label: str) -> tuple[str, str, str, int]:
    """The skill as applied, the commit before it (a), its commit (b), and how many later
    commits changed the recipe."""
    applied, commit_b, later = _skill_commit(repo, recipe_dir, skill, label)
    parents = repo.commit(commit_b).parents
    if not parents or workspace_git.tree_files(repo, parents[0].hexsha, recipe_dir) is None:
        raise BadInput(f"{applied} was applied in the first commit of {label} ({commit_b[:10]}): no commit holds the "
                       "recipe without it")
    return applied, parents[0].hexsha, commit_b, later


def _skill_commit(repo: Any, recipe_dir: Any, skill: str, label: str) -> tuple[str, str, int]:
    """The skill's trailer value (name@version), its newest commit of the recipe, and how many
    commits of the recipe came after it."""
    for later, commit in enumerate(workspace_git.path_commits(repo, recipe_dir)):
        for key, value in commit.trailers:
            if key == workspace_git.SKILL_APPLIED_TRAILER and workspace_git.applied_skill_name(value) == skill:
                return value, commit.sha, later
    raise BadInput(f"{skill} is not applied to {label} (no commit of it has a {workspace_git.SKILL_APPLIED_TRAILER}: {skill} trailer), so no "
                   f"commit holds its change to measure; apply it first (`trainwright apply {skill} {label}`, or "
                   "apply_skill), then run the A/B")


def _order(index: int) -> tuple[str, str]:
    return ("a", "b") if index % 2 == 0 else ("b", "a")


def _wait(ws: Workspace, run_id: str, steps: int, say: Progress) -> str:
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
                say(f"  {run_id}: step {step}/{steps}")
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


def _command(skill: str, label: str, steps: int, rounds: int, given: dict[str, Any], nproc: int, note: bool) -> str:
    parts = ["trainwright", "ab", skill, label, "--steps", str(steps), "--rounds", str(rounds)]
    if nproc != 1:
        parts += ["--nproc", str(nproc)]
    parts += [f"--set {key}={value if isinstance(value, str) else json.dumps(value)}" for key, value in given.items()]
    return " ".join(parts + (["--note"] if note else []))
