"""QLoRA's peak memory against LoRA's on the same model, in the same run of this benchmark.

The causal_lm template with the lora skill, and with the qlora skill (the same adapters on 4-bit
base weights), trains the same model (random tokens, a few steps) in alternating rounds, each a
fresh process. Per run it prints the peak memory while training (the resident set's high-water
mark on a CPU, ``torch.cuda.max_memory_allocated`` on a GPU, reset once the model, optimizer and
data are ready) and the peak while the model was built (on a CPU the full-precision weights
exist there before they are quantised; on a GPU they never reach the device), then the ratio
QLoRA / LoRA of the training peaks, per round and the median.

    python bench/qlora_memory.py [--rounds 2] [--steps 3] [--size medium|large]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from engine import run_dir as rd  # noqa: E402
from engine import run_metrics  # noqa: E402

SIZES = {  # the blocks' linear layers hold most of the weights, as in a pretrained model
    "medium": ("model.hidden_size=512", "model.intermediate_size=1408", "model.num_layers=8", "model.num_heads=8",
               "model.num_kv_heads=4"),
    "large": ("model.hidden_size=1024", "model.intermediate_size=2816", "model.num_layers=8", "model.num_heads=8",
              "model.num_kv_heads=4"),
}
RUN = ("data.source=random", "data.vocab_size=1000", "data.random_documents=64", "data.seq_len=256",
       "data.batch_size=4", "checkpoint.every=0", "checkpoint.at_end=false", "metrics.tensorboard=false",
       "train.log_every=1", "optim.warmup_steps=0")

# The engine, with the high-water marks reset once the run is prepared: what training itself holds.
RUNNER = """
import sys, torch, engine.engine
from engine.launch import main
from engine.memory import rss_high_water_mb

prepare = engine.engine.Engine.before_train


def before_train(self):
    prepare(self)
    built = torch.cuda.max_memory_allocated() / 2**20 if self.device.type == "cuda" else rss_high_water_mb()
    print("BUILD_PEAK_MB", built, flush=True)
    if self.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM starts again from the resident set now


engine.engine.Engine.before_train = before_train
sys.exit(main(sys.argv[1:]))
"""


def recipe(skill: str, root: Path) -> Path:
    from skills import apply_skill

    folder = root / skill
    shutil.copytree(REPO / "recipes_template" / "causal_lm", folder, ignore=shutil.ignore_patterns("__pycache__"))
    apply_skill(skill, folder, params={"rank": 8})
    return folder


def run(folder: Path, settings: list[str], cwd: Path) -> tuple[float, float, float]:
    """(training peak MB, build peak MB, last loss) of one run."""
    before = set(os.listdir(cwd / "runs")) if (cwd / "runs").is_dir() else set()
    command = [sys.executable, "-c", RUNNER, str(folder), *(a for s in settings for a in ("--set", s))]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=1200)
    if done.returncode:
        raise SystemExit(f"run failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    built = next(float(line.split()[1]) for line in done.stdout.splitlines() if line.startswith("BUILD_PEAK_MB"))
    (name,) = set(os.listdir(cwd / "runs")) - before
    records = [r for r in run_metrics.read_all_metrics(cwd / "runs" / name / rd.METRICS_JSONL) if "peak_mem_mb" in r]
    return max(r["peak_mem_mb"] for r in records), built, records[-1]["loss"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--size", default="large", choices=list(SIZES))
    args = parser.parse_args()
    settings = [*RUN, *SIZES[args.size], f"train.max_steps={args.steps}"]
    print(f"load average {os.getloadavg()[0]:.2f}; {args.size}: {' '.join(SIZES[args.size])}")
    print(f"{'round':<7}{'skill':<7}{'training peak MB':>18}{'build peak MB':>15}{'last loss':>11}")
    ratios = []
    with tempfile.TemporaryDirectory(prefix="trainwright-qlora-") as scratch:
        root = Path(scratch)
        folders = {skill: recipe(skill, root) for skill in ("lora", "qlora")}
        for index in range(1, args.rounds + 1):
            peaks = {}
            for skill in ("lora", "qlora") if index % 2 else ("qlora", "lora"):  # alternate which goes first
                peak, built, loss = run(folders[skill], settings, root)
                peaks[skill] = peak
                print(f"{index:<7}{skill:<7}{peak:>18,.0f}{built:>15,.0f}{loss:>11.4f}", flush=True)
            ratios.append(peaks["qlora"] / peaks["lora"])
            print(f"{index:<7}qlora / lora training peak: {ratios[-1]:.3f}", flush=True)
    print(json.dumps({"qlora_over_lora_training_peak": round(statistics.median(ratios), 3),
                      "per_round": [round(r, 3) for r in ratios]}))
    print(f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
