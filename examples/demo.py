"""``make demo``: the main job end to end on the built-in tiny model and data.

Creates a fresh workspace (``demo-workspace/``), copies the ``causal_lm`` template into it,
trains it on 2 processes with FSDP2, kills the run hard once a checkpoint exists, resumes it
from that checkpoint and prints what happened.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WORKSPACE = REPO / "demo-workspace"


def trainwright(*args: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "mcp_server.cli", *args, "--workspace", str(WORKSPACE), "--json"],
        capture_output=True, text=True, check=False,
    )
    if out.returncode != 0:
        sys.exit(f"trainwright {' '.join(args)} failed: {out.stdout}{out.stderr}")
    return json.loads(out.stdout)


def main() -> None:
    shutil.rmtree(WORKSPACE, ignore_errors=True)
    (WORKSPACE / "recipes").mkdir(parents=True)
    shutil.copytree(REPO / "recipes_template" / "causal_lm", WORKSPACE / "recipes" / "tiny_lm")
    subprocess.run(["git", "init", "-q", str(WORKSPACE)], check=True)

    steps = ["--set", "train.max_steps=60", "--set", "train.log_every=10", "--set", "checkpoint.every=20"]
    run = trainwright("run", "recipes/tiny_lm", "--nproc", "2", "--detach", *steps)
    print(f"launched {run['run_id']} on 2 processes")
    while not trainwright("checkpoints", run["run_id"])["checkpoints"]:
        time.sleep(1)
    status = trainwright("status", run["run_id"])
    print(f"checkpoint at step {status['checkpoints'][-1]['step']}; killing the training processes (SIGKILL)")
    subprocess.run(["pkill", "-KILL", "-f", f"engine.launch.*{run['run_id']}"], check=False)
    time.sleep(2)
    print(f"status after the kill: {trainwright('status', run['run_id'])['status']}")

    resumed = trainwright("resume", run["run_id"], "--detach")
    print(f"resumed as {resumed['run_id']} from step {resumed['resumed_from']['step']}")
    while trainwright("status", resumed["run_id"])["status"] in ("starting", "running"):
        time.sleep(2)
    final = trainwright("status", resumed["run_id"])
    first = trainwright("tail", run["run_id"], "-n", "1")["records"]
    print(f"first run reached loss {first[-1]['loss']:.3f}" if first else "first run logged nothing")
    latest = final["latest"] or {}
    print(
        f"resumed run {final['status']}: step {latest.get('step')}, loss {latest.get('loss', 0):.3f}, "
        f"{latest.get('tokens_per_s', 0):,.0f} tokens/s"
    )
    if final["status"] != "completed":
        sys.exit(1)


if __name__ == "__main__":
    main()
