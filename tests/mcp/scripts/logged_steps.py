"""A training script's output without the training (stdlib only), for the run view's tests: one
JSON line per step with a loss of ``3 - 0.3 * step`` and ``1000 + step`` tokens/s.

``--hold-after K``: after step K, wait for a file named ``go`` in the working directory (the
run's directory) before the next step; at most two minutes, then exit 3.
``--fail MESSAGE``: after the last step, exit with MESSAGE on stderr (status 1)."""

import argparse
import json
import os
import sys
import time

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=5)
parser.add_argument("--hold-after", type=int, default=0)
parser.add_argument("--fail", default=None)
options = parser.parse_args()

for step in range(1, options.steps + 1):
    print(json.dumps({"step": step, "loss": round(3.0 - 0.3 * step, 6), "tokens_per_s": 1000.0 + step}), flush=True)
    if step == options.hold_after:
        deadline = time.monotonic() + 120
        while not os.path.exists("go"):
            if time.monotonic() > deadline:
                sys.exit(3)
            time.sleep(0.05)
if options.fail is not None:
    sys.exit(options.fail)
