"""``trainwright review [BASE]``: what the agent changed since BASE, and what each change produced."""

from __future__ import annotations

import json
from collections import defaultdict

from engine import run_dir as rd
from engine import run_metrics
from runner import server_record as sr
from mcp_server.models import ReviewCommit, ReviewResult, ReviewRun
from workspace import git as workspace_git
from runner.provenance import code_description
from workspace.workspace import Workspace


def _runs_by_commit(ws: Workspace) -> dict[str, list[ReviewRun]]:
    by_commit: dict[str, list[ReviewRun]] = defaultdict(list)
    for run_id in ws.run_ids():
        try:
            record = sr.known_run(ws.root, ws.runs_dir / run_id)  # the commit is the server's, not the run's
        except (OSError, ValueError):
            continue
        if not record.git_commit:
            continue
        last = run_metrics.latest_metrics(ws.runs_dir / run_id / rd.METRICS_JSONL) or {}
        speed = run_metrics.read_run_speed(ws.runs_dir / run_id, record)
        by_commit[record.git_commit].append(
            ReviewRun(run_id=run_id, status=record.effective_status(), step=last.get("step"),
                      loss=run_metrics.finite_number(last.get("loss")),
                      mean_tokens_per_s=speed.mean_tokens_per_s if speed else None,
                      last_window_tokens_per_s=speed.last_window_tokens_per_s if speed else None,
                      speed=speed.describe() if speed else None,
                      code=code_description(record), overrides=record.overrides,
                      data=record.data.describe() if record.data else None)
        )
    return by_commit


def review(ws: Workspace, base: str | None = None) -> ReviewResult:
    repo = workspace_git.open_repo(ws.root)
    if repo is None:
        raise workspace_git.GitRefused("the workspace is not a git repository: there is nothing to review")
    runs = _runs_by_commit(ws)
    commits = []
    for commit in workspace_git.agent_commits(repo, base):
        trailers = commit.trailers
        commits.append(
            ReviewCommit(
                sha=commit.sha,
                subject=commit.subject,
                tool=trailers.get(workspace_git.TOOL_TRAILER, ""),
                skill=trailers.get(workspace_git.SKILL_APPLIED_TRAILER)
                or trailers.get(workspace_git.SCAFFOLDED_FROM_TRAILER),
                params=trailers.get(workspace_git.SKILL_PARAMS_TRAILER)
                or trailers.get(workspace_git.RECIPE_CONFIG_TRAILER),
                files_changed=commit.files_changed,
                insertions=commit.insertions,
                deletions=commit.deletions,
                runs=sorted(runs.get(commit.sha, []), key=lambda r: r.run_id),
                note=commit.note,
            )
        )
    return ReviewResult(base=base, commits=commits)


def format_review(result: ReviewResult) -> str:
    if not result.commits:
        return f"no agent commits since {result.base or 'the start'}"
    lines = []
    for c in result.commits:
        lines.append(f"{c.sha[:10]} {c.subject}")
        if c.skill:
            lines.append(f"    {('skill ' if c.tool == 'apply_skill' else 'from ')}{c.skill}  params {c.params}")
        lines.append(f"    {c.files_changed} file(s), +{c.insertions} -{c.deletions}")
        for r in c.runs:
            loss = f"loss {r.loss:.4f}" if isinstance(r.loss, float) else "no metrics"
            speed = f", {r.speed}" if r.speed else ""
            at = f" at step {r.step}" if r.step is not None else ", no step logged"
            lines.append(f"    run {r.run_id}: {r.status}{at}, {loss}{speed}")
            lines.append(f"      {r.code}")
            if r.overrides:
                lines.append("      overrides " + ", ".join(f"{k}={json.dumps(v)}" for k, v in r.overrides.items()))
            if r.data:
                lines.append(f"      {r.data}")
        if not c.runs:
            lines.append("    no runs launched from this commit")
    return "\n".join(lines)
