"""Apply every skill to every corpus script through ``apply_skill`` (on a temporary copy) and
classify each outcome: applied, already present, refused, crash, invalid result."""

from __future__ import annotations

import multiprocessing
import os
import re
import shutil
import sys
import tempfile
import time
import traceback
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from tests.skills.corpus.fetch import Script

APPLIED, ALREADY, REFUSED, CRASH, INVALID = "applied", "already", "refused", "crash", "invalid"

# A candidate named in a refusal: an expression and where it is, e.g. "`self._model` at recipe.py:12"
# or "recipe.py:12 `self._model`".
CANDIDATE = re.compile(r"`[^`]+`\s*(?:\(|at\s+)?[\w./-]+\.py:\d+|[\w./-]+\.py:\d+\)?:?\s*`[^`]+`")
FILE_LINE = re.compile(r"[\w./-]+\.py:\d+")
# What a refusal says it looked for.
LOOKED_FOR = re.compile(r"look(?:ed|s|ing)? for|found no|no \S+(?: \S+)? (?:found|in)|did not find|needs? |expects?", re.I)


@dataclass
class Outcome:
    skill: str
    script: str
    status: str
    message: str
    seconds: float
    diff: str = ""


def apply_one(skill: str, script: Script) -> Outcome:
    """``apply_skill`` (not a dry run: the result is read back from the copy, parsed and compiled)."""
    from skills import SkillError, apply_skill

    with tempfile.TemporaryDirectory(prefix="corpus-") as tmp:
        folder = Path(tmp) / script.id
        shutil.copytree(script.folder, folder)
        entry = folder / script.entry.name
        start = time.perf_counter()
        try:
            result = apply_skill(skill, entry)
        except SkillError as e:
            seconds = time.perf_counter() - start
            status = INVALID if "would not parse" in str(e) else REFUSED
            return Outcome(skill, script.id, status, str(e), seconds)
        except Exception:  # a codemod bug
            return Outcome(skill, script.id, CRASH, traceback.format_exc(limit=-3), time.perf_counter() - start)
        seconds = time.perf_counter() - start
        if result.already_applied:
            return Outcome(skill, script.id, ALREADY, result.message, seconds)
        problem = _invalid(folder)
        if problem:
            return Outcome(skill, script.id, INVALID, problem, seconds, result.diff)
        return Outcome(skill, script.id, APPLIED, result.message, seconds, result.diff)


def _invalid(folder: Path) -> str:
    import libcst as cst

    for path in sorted(folder.glob("*.py")):
        code = path.read_text(encoding="utf-8")
        try:
            cst.parse_module(code)
            compile(code, str(path), "exec", dont_inherit=True)
        except (cst.ParserSyntaxError, SyntaxError) as e:
            return f"{path.name} does not parse after the change: {e}"
    return ""


def refusal_problem(message: str) -> str:
    """Why a refusal's text falls short of the contract ("" when it does not): it names what it
    looked for or points at the code it saw (file:line); one that saw several candidates lists
    them, each with file:line and its expression, at most 5."""
    if not LOOKED_FOR.search(message) and not FILE_LINE.search(message):
        return "says neither what it looked for nor where (file:line) it saw something"
    if re.search(r"\b(several|candidates?|which one|ambiguous)\b", message, re.I):
        listed = CANDIDATE.findall(message)
        if not listed:
            return "mentions candidates without listing them as file:line + expression"
        if len(listed) > 5:
            return f"lists {len(listed)} candidates (at most 5)"
    return ""


def skill_names() -> list[str]:
    from skills import list_skill_cards

    return [card.name for card in list_skill_cards()]


def _use_skills_root(root: str | None) -> None:
    """Import ``skills`` (and what it imports) from another checkout; this module stays ours."""
    if root:
        sys.path.insert(0, str(Path(root).resolve()))


def _script_outcomes(script: Script) -> list[Outcome]:
    return [apply_one(skill, script) for skill in skill_names()]


def run(scripts: list[Script], skills_root: str | Path | None = None, workers: int | None = None) -> list[Outcome]:
    """Every skill on every script, in fresh worker processes (spawned: ``skills`` is imported
    there, from ``skills_root`` when given, never in this process)."""
    workers = workers or min(2, os.cpu_count() or 1)
    context = multiprocessing.get_context("spawn")
    root = str(skills_root) if skills_root else None
    with ProcessPoolExecutor(workers, mp_context=context, initializer=_use_skills_root, initargs=(root,)) as pool:
        # The largest scripts first, so that no worker is left with a big one at the end.
        ordered = sorted(scripts, key=lambda s: -sum(p.stat().st_size for p in s.folder.glob("*.py")))
        outcomes = [o for per_script in pool.map(_script_outcomes, ordered) for o in per_script]
    order = {s.id: i for i, s in enumerate(scripts)}
    return sorted(outcomes, key=lambda o: order[o.script])
