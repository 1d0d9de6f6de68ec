"""How OpenMP threads wait, measured: a hand-written training loop of the template's model with
libgomp's default (spinning), with ``OMP_WAIT_POLICY=PASSIVE`` (what every run gets,
``engine/openmp.py``), and spinning with a second OpenMP team kept alive on another thread (what a
first checkpoint used to do by a side effect: libgomp then counts more threads than CPUs and
throttles its spinning).

Each peer is a fresh subprocess with all cores' threads; peers are interleaved, the order reversed
every round. Printed per round: tokens/s and user CPU seconds per step (the work a step costs,
spinning included) after ``--warmup`` steps, and the load average. Spinning costs nothing on an
idle machine and a lot on a shared one, so read the rounds with their load.

    python bench/openmp_wait.py [--rounds 3] [--steps 15] [--warmup 3]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PEERS = {
    "spin": {},
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
    "spin + 2nd team": {"SECOND_TEAM": "1"},
}


def worker(steps: int, warmup: int) -> dict:
    sys.path.insert(0, str(REPO / "bench"))
    import torch
    import torch.nn.functional as F
    from throughput import batches_and_model, tokens

    if os.environ.get("SECOND_TEAM"):
        done = threading.Event()

        def second_team() -> None:
            torch.ones(1 << 22).mul_(2).sum()  # a parallel region: this thread gets its own team
            done.wait()

        threading.Thread(target=second_team, daemon=True).start()
    config, model, batches = batches_and_model(steps)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.optim.lr, fused=True)
    timed_tokens, start, cpu = 0, 0.0, 0.0
    for step, batch in enumerate(batches, 1):
        if step == warmup + 1:
            start, cpu = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF).ru_utime
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten(), ignore_index=-100)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step > warmup:
            timed_tokens += tokens(batch)
    timed = steps - warmup
    return {"tokens_per_s": timed_tokens / (time.perf_counter() - start),
            "user_cpu_per_step": (resource.getrusage(resource.RUSAGE_SELF).ru_utime - cpu) / timed,
            "threads": torch.get_num_threads()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.steps, args.warmup)))
        return 0
    threads = str(len(os.sched_getaffinity(0)))
    results: dict[str, list[dict]] = {peer: [] for peer in PEERS}
    for round_ in range(args.rounds):
        for peer in (list(PEERS) if round_ % 2 == 0 else list(PEERS)[::-1]):
            env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
            env.update({"OMP_NUM_THREADS": threads, **PEERS[peer]})
            load = os.getloadavg()[0]
            out = subprocess.run([sys.executable, __file__, "--worker", "--steps", str(args.steps),
                                  "--warmup", str(args.warmup)], env=env, capture_output=True, text=True)
            if out.returncode != 0:
                raise SystemExit(f"{peer} failed:\n{out.stderr[-3000:]}")
            result = json.loads(out.stdout.strip().splitlines()[-1])
            results[peer].append(result)
            print(f"round {round_ + 1}: {peer:<16} {result['tokens_per_s']:>7,.0f} tokens/s  "
                  f"user CPU {result['user_cpu_per_step']:.2f} s/step  ({result['threads']} threads, "
                  f"load {load:.1f})", flush=True)
    print()
    for peer, rows in results.items():
        speed = statistics.median(r["tokens_per_s"] for r in rows)
        cpu = statistics.median(r["user_cpu_per_step"] for r in rows)
        print(f"{peer:<16} median {speed:>7,.0f} tokens/s, {cpu:.2f} s user CPU per step")
    spin, passive = (statistics.median(r["tokens_per_s"] for r in results[p]) for p in ("spin", "passive"))
    print(f"\npassive / spin: {passive / spin:.2f}x tokens/s; load average at end {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
