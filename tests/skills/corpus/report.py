"""Print, per skill, what it does on the corpus of third-party training scripts.

    python -m tests.skills.corpus.report                       # this checkout's skills
    python -m tests.skills.corpus.report --skills-root ../other  # another checkout's skills/
    python -m tests.skills.corpus.report --refusals            # and the refusals, grouped

Statuses: applied, already (the pattern is there), refused, crash (an exception other than a
SkillError), invalid (the result does not parse or compile).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import time
from collections import Counter, defaultdict
from pathlib import Path

from tests.skills.corpus import harness
from tests.skills.corpus.fetch import Script, fetch

# The bar: these skills apply (or are already there) on ≥ 80% of the scripts with an
# explicit backward() loop, gradient-checkpointing on ≥ 80% of those that train a transformer.
LOOP_SKILLS = ("loss-guard", "mixed-precision", "torch-compile")
TRANSFORMER_SKILLS = ("gradient-checkpointing",)
BAR = 0.8
STATUSES = (harness.APPLIED, harness.ALREADY, harness.REFUSED, harness.CRASH, harness.INVALID)
LETTER = {harness.APPLIED: "A", harness.ALREADY: "=", harness.REFUSED: ".", harness.CRASH: "X", harness.INVALID: "!"}


def population(skill: str, scripts: list[Script]) -> list[Script]:
    """The scripts a skill is held to: those with an explicit loop, or that train a transformer."""
    if skill in LOOP_SKILLS:
        return [s for s in scripts if s.explicit_loop]
    if skill in TRANSFORMER_SKILLS:
        return [s for s in scripts if s.trains_transformer]
    return []


def rate(skill: str, scripts: list[Script], outcomes: list[harness.Outcome]) -> tuple[int, int]:
    held = {s.id for s in population(skill, scripts)}
    ok = sum(1 for o in outcomes if o.skill == skill and o.script in held and o.status in (harness.APPLIED, harness.ALREADY))
    return ok, len(held)


def table(scripts: list[Script], outcomes: list[harness.Outcome]) -> str:
    skills = sorted({o.skill for o in outcomes})
    head = f"{'skill':24}" + "".join(f"{s:>9}" for s in STATUSES) + f"{'held to':>14}{'rate':>7}{'bad refusal':>13}"
    lines = [head, "-" * len(head)]
    for skill in skills:
        mine = [o for o in outcomes if o.skill == skill]
        counts = Counter(o.status for o in mine)
        ok, n = rate(skill, scripts, outcomes)
        held = f"{ok}/{n}" if n else "-"
        pct = f"{ok / n:.0%}" if n else "-"
        bad = sum(1 for o in mine if o.status == harness.REFUSED and harness.refusal_problem(o.message))
        lines.append(f"{skill:24}" + "".join(f"{counts[s]:>9}" for s in STATUSES) + f"{held:>14}{pct:>7}{bad:>13}")
    return "\n".join(lines)


def matrix(scripts: list[Script], outcomes: list[harness.Outcome]) -> str:
    skills = sorted({o.skill for o in outcomes})
    status = {(o.skill, o.script): o.status for o in outcomes}
    lines = ["  ".join(f"{i:>2}" for i in range(len(skills))) + "   script (tags: L explicit loop, T transformer)"]
    lines += [f"{i:>2} {s}" for i, s in enumerate(skills)][:0]
    for script in scripts:
        tags = ("L" if script.explicit_loop else "-") + ("T" if script.trains_transformer else "-")
        lines.append("  ".join(f"{LETTER[status[(k, script.id)]]:>2}" for k in skills) + f"   {tags} {script.id}")
    legend = ", ".join(f"{i}={s}" for i, s in enumerate(skills))
    return "\n".join(lines) + f"\ncolumns: {legend}\nA applied, = already there, . refused, X crash, ! invalid"


def normalize(message: str) -> str:
    """A refusal with its script-specific parts (expressions, places, file names) blanked, to group by cause."""
    text = re.sub(r"`[^`]*`", "`…`", message)
    text = re.sub(r"[\w./-]+\.py(:\d+)?", "FILE", text)
    text = re.sub(r"\b[A-Z]\w+\(\.\.\.\)", "CLS(...)", text)
    return text


def refusals(scripts: list[Script], outcomes: list[harness.Outcome], skills: tuple[str, ...]) -> str:
    held = {skill: {s.id for s in population(skill, scripts)} for skill in skills}
    out = []
    for skill in skills:
        groups: dict[str, list[harness.Outcome]] = defaultdict(list)
        for o in outcomes:
            if o.skill == skill and o.script in held[skill] and o.status not in (harness.APPLIED, harness.ALREADY):
                groups[normalize(o.message)].append(o)
        out.append(f"\n## {skill}: {sum(map(len, groups.values()))} of {len(held[skill])} held-to scripts not reached")
        for _, group in sorted(groups.items(), key=lambda kv: -len(kv[1])):
            out.append(f"- {len(group)}x {', '.join(o.script for o in group)}\n    e.g. {group[0].message[:600]}")
    return "\n".join(out)


def failures(scripts: list[Script], outcomes: list[harness.Outcome]) -> list[str]:
    """What falls short of the bar, one line each ([] when all holds)."""
    problems = [f"{o.status}: {o.skill} on {o.script}: {o.message.strip().splitlines()[-1][:300]}"
                for o in outcomes if o.status in (harness.CRASH, harness.INVALID)]
    for skill in LOOP_SKILLS + TRANSFORMER_SKILLS:
        ok, n = rate(skill, scripts, outcomes)
        if n and ok / n < BAR:
            problems.append(f"rate: {skill} applies or is already there on {ok}/{n} ({ok / n:.0%} < {BAR:.0%})")
    problems += [f"refusal: {o.skill} on {o.script}: {harness.refusal_problem(o.message)}: {o.message[:300]}"
                 for o in outcomes if o.status == harness.REFUSED and harness.refusal_problem(o.message)]
    return problems


def pointing(everything: list[harness.Outcome]) -> str:
    """The retries that name one of a refusal's candidates as ``target``."""
    lines = ["retries with target= (one per candidate a refusal listed):"]
    for o in everything:
        if o.target:
            others = next(harness.candidates(p.message) for p in everything
                          if p.skill == o.skill and p.script == o.script and not p.target)
            problem = harness.pointing_problem(o, others)
            lines.append(f"  {o.skill} on {o.script} target={o.target!r}: {o.status}"
                         + (f"  <- {problem}" if problem else f": {o.message[:160]}"))
    return "\n".join(lines) if len(lines) > 1 else "no refusal listed several candidates for a skill that takes target"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skills-root", help="a checkout whose skills/ to measure (default: this one)")
    parser.add_argument("--refusals", action="store_true", help="also print the refusals of the held-to skills, grouped")
    parser.add_argument("--matrix", action="store_true", help="also print the script × skill matrix")
    parser.add_argument("--json", help="also write every outcome (with diffs) to this file")
    parser.add_argument("--workers", type=int, default=None)
    args = parser.parse_args()
    scripts = fetch()
    start = time.perf_counter()
    everything = harness.run(scripts, skills_root=args.skills_root, workers=args.workers)
    seconds = time.perf_counter() - start
    outcomes = [o for o in everything if not o.target]
    if args.json:
        Path(args.json).write_text(json.dumps([dataclasses.asdict(o) for o in everything], indent=1))
    loops = sum(s.explicit_loop for s in scripts)
    transformers = sum(s.trains_transformer for s in scripts)
    print(f"{len(scripts)} scripts from {len({s.package for s in scripts})} packages ({loops} with an explicit loop, "
          f"{transformers} training a transformer); skills from {args.skills_root or 'this checkout'}; {seconds:.0f} s\n")
    print(table(scripts, outcomes))
    if args.matrix:
        print("\n" + matrix(scripts, outcomes))
    if args.refusals:
        print(refusals(scripts, outcomes, LOOP_SKILLS + TRANSFORMER_SKILLS))
    print("\n" + pointing(everything))
    problems = failures(scripts, outcomes) + [line for line in pointing(everything).splitlines() if "  <- " in line]
    print(f"\n{len(problems)} short of the bar" + "".join(f"\n  {p}" for p in problems))


if __name__ == "__main__":
    main()
