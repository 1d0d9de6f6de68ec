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
# The skills retried with `target` where a refusal asks which model (the others cost time and say the same).
RETRIED = ("gradient-checkpointing", "loss-guard", "mixed-precision", "torch-compile", "lora", "freeze")

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
    target: str = ""  # the `target` param of a retry that points at one of a refusal's candidates


def apply_one(skill: str, script: Script, target: str = "") -> Outcome:
    """``apply_skill`` (not a dry run: the result is read back from the copy, parsed and compiled)."""
    from skills import SkillError, apply_skill

    params = {"target": target} if target else None

    with tempfile.TemporaryDirectory(prefix="corpus-") as tmp:
        folder = Path(tmp) / script.id
        shutil.copytree(script.folder, folder)
        entry = folder / script.entry.name
        start = time.perf_counter()
        try:
            result = apply_skill(skill, entry, params)
        except SkillError as e:
            seconds = time.perf_counter() - start
            status = INVALID if "would not parse" in str(e) else REFUSED
            return Outcome(skill, script.id, status, str(e), seconds, target=target)
        except Exception:  # a codemod bug
            return Outcome(skill, script.id, CRASH, traceback.format_exc(limit=-3), time.perf_counter() - start, target=target)
        seconds = time.perf_counter() - start
        if result.already_applied:
            return Outcome(skill, script.id, ALREADY, result.message, seconds, target=target)
        problem = _invalid(folder)
        if problem:
            return Outcome(skill, script.id, INVALID, problem, seconds, result.diff, target=target)
        return Outcome(skill, script.id, APPLIED, result.message, seconds, result.diff, target=target)


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


def candidates(message: str) -> list[str]:
    """The expressions a refusal lists as candidates, in order, without repeats."""
    found = []
    for match in CANDIDATE.finditer(message):
        expression = re.search(r"`([^`]+)`", match.group(0)).group(1)
        if expression not in found:
            found.append(expression)
    return found


def pointers(message: str) -> list[str]:
    """What an agent would pass as ``target`` to pick each candidate: its expression, or its
    ``file.py:LINE`` where the same expression is listed at several places."""
    listed = [(re.search(r"`([^`]+)`", m.group(0)).group(1), FILE_LINE.search(m.group(0)).group(0))
              for m in CANDIDATE.finditer(message)]
    expressions = [e for e, _ in listed]
    chosen = []
    for expression, place in listed:
        pointer = expression if expressions.count(expression) == 1 else place.rsplit("/", 1)[-1]
        if pointer not in chosen:
            chosen.append(pointer)
    return chosen


def takes_target(skill: str) -> bool:
    from skills.registry import skill as find_skill

    return "target" in find_skill(skill).codemod.Params.model_fields


def _script_outcomes(script: Script) -> list[Outcome]:
    """Every skill on the script; where one of ``RETRIED`` refuses for want of a choice between
    several candidates, one retry per candidate (at most 3) that names it as ``target``."""
    outcomes = [apply_one(skill, script) for skill in skill_names()]
    for first in list(outcomes):
        asks = first.status == REFUSED and re.search(r"\b(several|which one|candidates)\b", first.message)
        named = pointers(first.message) if asks else []
        if len(named) > 1 and first.skill in RETRIED and takes_target(first.skill):
            outcomes += [apply_one(first.skill, script, target) for target in named[:3]]
    return outcomes


def _added_outside_helpers(diff: str) -> str:
    """The lines a change adds, less the module-level helpers it defines (their parameters are
    often named ``model`` and say nothing about which model the change acts on)."""
    kept, in_helper = [], False
    for line in diff.splitlines():
        if not line.startswith("+") or line.startswith("+++"):
            in_helper = False
            continue
        body = line[1:]
        if re.match(r"(def|class|async def) |@", body):
            in_helper = True
        elif body and not body[0].isspace() and not body.startswith((")", "]")):
            in_helper = False
        if not in_helper:
            kept.append(body)
    return "\n".join(kept)


def pointing_problem(outcome: Outcome, others: list[str]) -> str:
    """Why a retry with ``target`` did not settle on that one model ("" when it did): it takes the
    target and does not ask again (a refusal for another reason is an answer), and what it adds
    names the target and hands none of the other candidates to a call."""
    if outcome.status in (CRASH, INVALID):
        return f"{outcome.status}: {outcome.message[-300:]}"
    if outcome.status == REFUSED:
        if re.search(r"\b(several|which one)\b", outcome.message):
            return f"still asks which one: {outcome.message[:300]}"
        if re.search(rf"target\W+{re.escape(outcome.target)}", outcome.message):
            return f"does not take the target: {outcome.message[:300]}"
    if outcome.status == APPLIED:
        added = _added_outside_helpers(outcome.diff)
        name = outcome.target.split(":")[0].rsplit(".", 1)[-1]
        if ":" not in outcome.target and not re.search(rf"\b{re.escape(name)}\b", added):  # file:LINE: not checked
            return f"the change does not name `{outcome.target}`"
        # Another candidate handed whole to a call (`checkpoint_blocks(other)`, `torch.compile(other)`);
        # `other.parameters()` in a rewritten optimizer line is not acting on it.
        touched = [o for o in others if o != outcome.target
                   and re.search(rf"[(,\[]\s*{re.escape(o)}\s*[,)\]]", added)]
        if touched:
            return f"the change also acts on {touched}"
    return ""


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
