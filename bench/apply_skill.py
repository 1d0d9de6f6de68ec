"""How long applying each skill takes: the codemod on a fresh copy of the causal_lm template.

    python bench/apply_skill.py [--repeat 15]

Prints the median wall time per skill (goal: < 100 ms each) and the CPU time, which suffers
less from other work on the machine. Each timed call is a real ``apply_skill`` (parse, find
anchors, edit, re-parse and compile the result, diff, atomic write) on its own fresh copy.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from skills import apply_skill, list_skills  # noqa: E402

GOAL_MS = 100.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=15, help="timed applications per skill")
    args = parser.parse_args()
    template = REPO / "recipes_template" / "causal_lm"
    names = [s.name for s in list_skills()]
    print(f"apply_skill on the causal_lm template ({args.repeat} fresh copies per skill)")
    print(f"{'skill':<24} {'median ms':>10} {'min ms':>8} {'cpu ms':>8}")
    slowest = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:  # warm-up: imports and the codemod modules are loaded once
            warm = Path(tmp) / f"warm-{name}"
            shutil.copytree(template, warm)
            apply_skill(name, warm)
        for name in names:
            wall, cpu = [], []
            for i in range(args.repeat):
                copy = Path(tmp) / f"{name}-{i}"
                shutil.copytree(template, copy)
                start_wall, start_cpu = time.perf_counter(), time.process_time()
                result = apply_skill(name, copy)
                wall.append((time.perf_counter() - start_wall) * 1e3)
                cpu.append((time.process_time() - start_cpu) * 1e3)
                assert result.changed, result.message
            median = statistics.median(wall)
            slowest = max(slowest, median)
            print(f"{name:<24} {median:>10.1f} {min(wall):>8.1f} {statistics.median(cpu):>8.1f}")
    verdict = "within" if slowest < GOAL_MS else "OVER"
    print(f"slowest median {slowest:.1f} ms: {verdict} the {GOAL_MS:.0f} ms goal")
    return 0 if slowest < GOAL_MS else 1


if __name__ == "__main__":
    sys.exit(main())
