"""What the bubblewrap sandbox costs a run: start time and tokens/s, with and without it.

Peers, measured in the same process, interleaved (the order alternates every round):

- ``sandbox``: a run as launched by default (``isolation: full``);
- ``no sandbox``: the same run with ``TRAINWRIGHT_BWRAP`` empty, i.e. the fallback (a network
  namespace and the allow-listed environment: ``isolation: partial``).

First the sandbox's own cost, without training: spawning ``python -c pass`` through
:func:`sandbox.bwrap.wrap` (which probes bubblewrap, then runs it) against spawning it plainly,
interleaved, ``--spawns`` times each. Then, for each run: the launch check's time
(``check_launch``, which imports the recipe in the same sandbox), the time from ``start_run`` to the engine's first console line and to the first
metrics record, and the median tokens/s of the records after the first (warm-up). Every round
is printed, then the medians, and the median over rounds of the ratio and difference of the two
peers of one round (they ran back to back). Goal: < 1 s more to start (the check plus the time
to the engine's first line), ≥ 0.98x tokens/s.

    python bench/sandbox_overhead.py [--rounds 5] [--steps 40] [--nproc 1] [--set KEY=VALUE ...]

The template's model and data by default; ``--set`` overrides them (e.g. a smaller model on a
loaded machine, so that each round takes seconds).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from engine import run_dir as rd  # noqa: E402
from engine import run_metrics  # noqa: E402
from sandbox import bwrap  # noqa: E402
from workspace import git as workspace_git  # noqa: E402
from runner import lifecycle as run_lifecycle  # noqa: E402
from workspace.settings import RunLimits  # noqa: E402
from engine.config import overrides_to_dict  # noqa: E402
from runner.provenance import CodeOrigin  # noqa: E402
from tests.support import wait_for  # noqa: E402

TEMPLATE = REPO / "recipes_template" / "causal_lm"
PEERS = ("sandbox", "no sandbox")
START_GOAL_S, SPEED_GOAL = 1.0, 0.98


def workspace(root: Path) -> Path:
    recipe = root / "recipes" / "lm"
    shutil.copytree(TEMPLATE, recipe, ignore=shutil.ignore_patterns("__pycache__"))
    workspace_git.commit_paths(workspace_git.ensure_repo(root), [recipe], "add recipe lm", [])
    return root


def first_metrics(run_dir: Path) -> bool:
    path = run_dir / rd.METRICS_JSONL
    return path.is_file() and path.stat().st_size > 0


def engine_started(run_dir: Path, run_id: str) -> bool:
    path = run_dir / rd.CONSOLE_LOG
    return path.is_file() and f"run {run_id}:" in path.read_text(errors="replace")


def one_run(root: Path, peer: str, overrides: list[str], nproc: int, threads: int) -> dict:
    os.environ[bwrap.BWRAP_VARIABLE] = "" if peer == "no sandbox" else (bwrap.find_bwrap({}) or "")
    limits = RunLimits(threads_per_process=threads)
    recipe = root / "recipes" / "lm"
    started = time.perf_counter()
    verdict = run_lifecycle.check_launch(root, recipe, nproc, overrides, limits=limits)
    check_s = time.perf_counter() - started
    started = time.perf_counter()
    plan = run_lifecycle.LaunchPlan(recipe, "recipes/lm", nproc, CodeOrigin(git_commit=None, recipe_dirty=None),
                                    overrides_to_dict(overrides), verdict, limits=limits)
    record = run_lifecycle.start_run(root, root / "runs", plan)
    run_dir = root / "runs" / record.id
    wait_for(lambda: engine_started(run_dir, record.id), 300, 0.01)
    first_line_s = time.perf_counter() - started
    wait_for(lambda: first_metrics(run_dir), 300, 0.01)
    first_metrics_s = time.perf_counter() - started
    final = wait_for(lambda: (r := rd.read_run(run_dir)).status in rd.FINAL_STATUSES
                     and not rd.pid_alive(r.pid) and r, 900, 0.1)
    if final.status != rd.COMPLETED:
        raise SystemExit(f"{peer}: run {final.id} {final.status}: {final.error}")
    speeds = [m["tokens_per_s"] for m in run_metrics.read_all_metrics(run_dir / rd.METRICS_JSONL)[1:]]
    return {"peer": peer, "isolation": final.isolation, "check_s": check_s, "first_line_s": first_line_s,
            "first_metrics_s": first_metrics_s, "tokens_per_s": statistics.median(speeds)}


def spawn_overhead(root: Path, spawns: int) -> dict[str, float]:
    """Median seconds to run ``python -c pass`` plainly and through the sandbox (probe included)."""
    import subprocess

    times: dict[str, list[float]] = {"plain": [], "sandbox": []}
    command = [sys.executable, "-S", "-c", "pass"]
    for i in range(spawns):
        for peer in (("plain", "sandbox") if i % 2 == 0 else ("sandbox", "plain")):
            started = time.perf_counter()
            if peer == "sandbox":
                wrapped = bwrap.wrap(command, [root], [], cwd=root)
                assert wrapped.sandboxed, wrapped.reason
                subprocess.run(wrapped.command, check=True)
            else:
                subprocess.run(command, check=True, cwd=root)
            times[peer].append(time.perf_counter() - started)
    return {peer: statistics.median(values) for peer, values in times.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--log-every", type=int, default=5)
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--spawns", type=int, default=20, help="spawns of python -c pass per peer")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for every run, e.g. --set model.hidden_size=128")
    parser.add_argument("--json", action="store_true", help="print the results as one JSON object")
    args = parser.parse_args()
    reason = bwrap.probe(bwrap.find_bwrap())
    if reason is not None:
        print(f"bubblewrap cannot run here ({reason}): nothing to compare", file=sys.stderr)
        return 2
    threads = max(1, len(os.sched_getaffinity(0)) // args.nproc)
    overrides = [f"train.max_steps={args.steps}", f"train.log_every={args.log_every}", "checkpoint.every=0",
                 *args.overrides]
    results: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="trainwright-bench-") as scratch:
        root = workspace(Path(scratch) / "ws")
        spawn = spawn_overhead(root, args.spawns)
        print(f"python -c pass, median of {args.spawns}: plain {spawn['plain'] * 1000:.0f} ms, through the "
              f"sandbox {spawn['sandbox'] * 1000:.0f} ms (+{(spawn['sandbox'] - spawn['plain']) * 1000:.0f} ms)\n")
        print(f"{args.rounds} rounds, {args.steps} steps, {args.nproc} process(es), {threads} thread(s) each, "
              f"overrides: {' '.join(args.overrides) or 'none'}")
        print(f"{'round':>5} {'peer':<11} {'isolation':<9} {'check s':>8} {'1st line s':>10} "
              f"{'1st metrics s':>13} {'tokens/s':>9}")
        for round_ in range(args.rounds):
            for peer in (PEERS if round_ % 2 == 0 else PEERS[::-1]):
                result = one_run(root, peer, overrides, args.nproc, threads)
                results.append({"round": round_ + 1, **result})
                print(f"{round_ + 1:>5} {peer:<11} {result['isolation']:<9} {result['check_s']:>8.2f} "
                      f"{result['first_line_s']:>10.2f} {result['first_metrics_s']:>13.2f} "
                      f"{result['tokens_per_s']:>9,.0f}", flush=True)

    def median(peer: str, key: str) -> float:
        return statistics.median(r[key] for r in results if r["peer"] == peer)

    def paired(key: str) -> tuple[float, float]:
        """Median over rounds of (sandbox / no sandbox, sandbox - no sandbox) within each round:
        the two peers of a round ran back to back, so the machine's load drifts less between them."""
        by_round = {}
        for r in results:
            by_round.setdefault(r["round"], {})[r["peer"]] = r[key]
        pairs = [(v["sandbox"], v["no sandbox"]) for v in by_round.values() if len(v) == 2]
        return (statistics.median(a / b for a, b in pairs), statistics.median(a - b for a, b in pairs))

    summary = {}
    for key in ("check_s", "first_line_s", "first_metrics_s", "tokens_per_s"):
        with_, without = median("sandbox", key), median("no sandbox", key)
        ratio, difference = paired(key)
        summary[key] = {"sandbox": with_, "no sandbox": without, "paired_ratio": ratio, "paired_difference": difference}
    print("\n                   medians          per round, median of")
    print("                 sandbox  no sandbox   ratio   difference")
    for key, row in summary.items():
        print(f"{key:<15} {row['sandbox']:>9.2f} {row['no sandbox']:>11.2f} {row['paired_ratio']:>7.3f}x "
              f"{row['paired_difference']:>+11.2f}")
    start = summary["first_line_s"]["paired_difference"] + summary["check_s"]["paired_difference"]
    speed = summary["tokens_per_s"]["paired_ratio"]
    print(f"\nstart (check + engine's first line): {start:+.2f} s with the sandbox (goal < {START_GOAL_S:.0f} s): "
          f"{'met' if start < START_GOAL_S else 'NOT met'}")
    print(f"tokens/s: {speed:.3f}x with the sandbox (goal >= {SPEED_GOAL}x): {'met' if speed >= SPEED_GOAL else 'NOT met'}")
    if args.json:
        print(json.dumps({"spawn": spawn, "rounds": results, "summary": summary}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
