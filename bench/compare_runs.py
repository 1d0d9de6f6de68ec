"""compare_runs on the three pairs whose verdicts are known in advance, printed as the CLI prints them:

1. the same config, seeds 0 and 7: tokens/s "no difference";
2. the template vs gradient-checkpointing (6 layers, 16 × 256 positions): loss bit-equal, peak
   memory better, step time worse;
3. the template vs sequence-packing on documents of 20–250 bytes in rows of 256: tokens/s better,
   with the ratio.

The two runs of a pair train at the same time (each one thread), so whatever else loads the
machine falls on both; the load average is printed before each pair.

    python bench/compare_runs.py [--steps 30] [--log-every 3] [--pairs seed ckpt packing]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from mcp_server.operations import compare  # noqa: E402
from mcp_server.operations import recipes as recipe_ops  # noqa: E402
from mcp_server.operations import launch as launching  # noqa: E402
from mcp_server.operations import runs as run_ops  # noqa: E402
from mcp_server.terminal import compare_text  # noqa: E402
from workspace.workspace import Workspace  # noqa: E402
from tests.skills.skill_helpers import write_documents  # noqa: E402
from tests.support import TINY  # noqa: E402

QUIET = ("checkpoint.every=0", "checkpoint.at_end=false", "metrics.tensorboard=false")
ACTIVATIONS = ("model.num_layers=6", "data.seq_len=256", "data.batch_size=16")
ROWS = ("data.seq_len=256", "data.batch_size=8")


def finished(ws: Workspace, run_id: str) -> str:
    while (status := run_ops.get_run(ws, run_id).status) not in ("completed", "failed", "stopped"):
        time.sleep(0.5)
    if status != "completed":
        raise SystemExit(f"run {run_id} {status}:\n{run_ops.get_run(ws, run_id).console_tail}")
    return run_id


def pair(ws: Workspace, a: tuple[str, list[str]], b: tuple[str, list[str]]) -> None:
    print(f"\nload average {os.getloadavg()[0]:.2f}", flush=True)
    started = [launching.launch_run(ws, recipe, 1, overrides).run_id for recipe, overrides in (a, b)]
    run_a, run_b = (finished(ws, run_id) for run_id in started)
    print(compare_text(compare.compare_runs(ws, run_a, run_b)), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--log-every", type=int, default=3)
    parser.add_argument("--pairs", nargs="+", default=["seed", "ckpt", "packing"], choices=["seed", "ckpt", "packing"])
    args = parser.parse_args()
    schedule = [*TINY, *QUIET, f"train.max_steps={args.steps}", f"train.log_every={args.log_every}"]
    with tempfile.TemporaryDirectory(prefix="trainwright-compare-") as root:
        ws = Workspace.open(root)
        recipe_ops.scaffold_recipe(ws, "causal_lm", "plain")
        if "ckpt" in args.pairs:
            recipe_ops.scaffold_recipe(ws, "causal_lm", "ckpt", skills=["gradient-checkpointing"])
        if "packing" in args.pairs:
            recipe_ops.scaffold_recipe(ws, "causal_lm", "packed", skills=["sequence-packing"])
        docs = write_documents(Path(root) / "docs.jsonl", 600, 4, 45)
        on_docs = ["data.source=files", f"data.paths=[{docs}]"]
        if "seed" in args.pairs:
            pair(ws, ("recipes/plain", [*schedule, *ACTIVATIONS]), ("recipes/plain", [*schedule, *ACTIVATIONS, "train.seed=7"]))
        if "ckpt" in args.pairs:
            pair(ws, ("recipes/plain", [*schedule, *ACTIVATIONS]), ("recipes/ckpt", [*schedule, *ACTIVATIONS]))
        if "packing" in args.pairs:
            pair(ws, ("recipes/plain", [*schedule, *ROWS, *on_docs]), ("recipes/packed", [*schedule, *ROWS, *on_docs]))


if __name__ == "__main__":
    main()
