"""How OpenMP threads wait, measured on a quiet machine and beside a competing CPU-bound process.

Peers, each a fresh subprocess with one thread per core, training the template's model on the
same batches (``bench/throughput.py``'s peers):

- ``loop``: a hand-written PyTorch loop under libgomp's default policy (threads spin
  300,000 times between parallel regions before they sleep);
- ``loop passive``: the same loop under ``OMP_WAIT_POLICY=PASSIVE`` (a waiting thread sleeps at once);
- ``loop spin=N``: the same loop under ``GOMP_SPINCOUNT=N`` for each ``--spin-counts`` value;
- ``engine``: ``python -m engine.launch`` on the template, under the policy every run gets
  (``engine/openmp.py``).

Each peer runs twice per round: on the machine as it is (``quiet``), and with one competing
CPU-bound process (a single-threaded busy loop) started just before it and killed after it
(``busy``). Peers are interleaved, the order reversed every round. Printed: every round's
tokens/s with the load average, the medians, and the ratios the wait policy is judged by:
the engine against the loop under the default policy in both cases.

    python bench/openmp_wait.py [--rounds 3] [--steps 30] [--warmup 5] [--spin-counts 10000,100000]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
POLICY_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
COMPETITOR = [sys.executable, "-c", "while True: pass"]


def peers(spin_counts: list[int]) -> dict[str, tuple[str, dict[str, str]]]:
    """name -> (worker, environment additions). The engine sets its own policy."""
    table = {"loop": ("hand", {}), "loop passive": ("hand", {"OMP_WAIT_POLICY": "PASSIVE"})}
    table.update({f"loop spin={n}": ("hand", {"GOMP_SPINCOUNT": str(n)}) for n in spin_counts})
    table["engine"] = ("engine", {})
    return table


def worker(kind: str, steps: int, warmup: int) -> dict:
    sys.path[:0] = [str(REPO), str(REPO / "bench")]  # throughput's peers import bench.cpu_time
    from throughput import run_engine, run_hand

    return (run_engine if kind == "engine" else run_hand)(steps, warmup, False)


def measure(kind: str, extra: dict[str, str], busy: bool, steps: int, warmup: int) -> float:
    env = {k: v for k, v in os.environ.items() if k not in POLICY_VARIABLES}
    env.update({"OMP_NUM_THREADS": str(len(os.sched_getaffinity(0))), **extra})
    competitor = subprocess.Popen(COMPETITOR) if busy else None
    try:
        out = subprocess.run([sys.executable, __file__, "--worker", kind, "--steps", str(steps),
                              "--warmup", str(warmup)], env=env, capture_output=True, text=True, cwd=REPO)
    finally:
        if competitor is not None:
            competitor.kill()
            competitor.wait()
    if out.returncode != 0:
        raise SystemExit(f"{kind} failed:\n{out.stderr[-3000:]}")
    return float(json.loads(out.stdout.strip().splitlines()[-1])["tokens_per_s"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--spin-counts", default="10000,100000",
                        help="GOMP_SPINCOUNT values to measure the loop under (comma-separated; empty: none)")
    parser.add_argument("--worker", choices=("hand", "engine"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps % args.warmup:
        parser.error("--steps must be a multiple of --warmup (the engine logs every --warmup steps)")
    if args.worker:
        print(json.dumps(worker(args.worker, args.steps, args.warmup)))
        return 0
    table = peers([int(n) for n in args.spin_counts.split(",") if n.strip()])
    cases = [(name, busy) for busy in (False, True) for name in table]
    results: dict[tuple[str, bool], list[float]] = {case: [] for case in cases}
    for round_ in range(args.rounds):
        for name, busy in (cases if round_ % 2 == 0 else cases[::-1]):
            load = os.getloadavg()[0]
            kind, extra = table[name]
            speed = measure(kind, extra, busy, args.steps, args.warmup)
            results[(name, busy)].append(speed)
            print(f"round {round_ + 1}: {'busy' if busy else 'quiet'}  {name:<18} {speed:>7,.0f} tokens/s "
                  f"(load {load:.1f})", flush=True)
    median = {case: statistics.median(values) for case, values in results.items()}
    print(f"\n{'peer':<20}{'quiet':>10}{'busy':>10}   tokens/s, median of {args.rounds} rounds")
    for name in table:
        print(f"{name:<20}{median[(name, False)]:>10,.0f}{median[(name, True)]:>10,.0f}")
    for busy in (False, True):
        case = "busy" if busy else "quiet"
        ratio = median[("engine", busy)] / median[("loop", busy)]
        goal = "≥ 0.90" if busy else "≥ 0.97"
        print(f"{case}: engine / loop (default policy): {ratio:.3f}  (goal {goal})")
    print(f"busy: engine / loop passive: {median[('engine', True)] / median[('loop passive', True)]:.3f}")
    print(f"load average at end: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
