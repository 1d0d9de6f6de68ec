"""What redacting every tool result costs, against serializing that result (which every call
does anyway), in the same run.

The redactor holds the values of a server environment of ~60 variables (10 secret by name, by
URL or by shape); the result is a ``MetricsTail`` of 200 records plus a 20 kB console text —
a large tool result. Rounds interleave the two; each round's median is printed, and the ratio
of the overall medians. Serialization is the cheapest step of a tool call, so the ratio is
large; the goal is an absolute one: under 1 ms for such a result (an in-memory tool call round
trip takes several milliseconds).

    python bench/redaction.py [--rounds 5] [--repeats 50]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mcp_server.models import MetricsTail  # noqa: E402
from sandbox import redact as redaction  # noqa: E402

ENVIRONMENT = {
    **{f"ORDINARY_SETTING_{i}": f"/opt/tool-{i}/bin:/usr/local/share/{i}" for i in range(50)},
    "HF_TOKEN": "hf_" + "a1B2c3D4e5" * 3, "AWS_SECRET_ACCESS_KEY": "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
    "MYSQL_PWD": "hunter2-mysql-pw", "REDIS_URL": "redis://:r3dis-pass-word@cache:6379/0",
    "STRIPE_SK": "stripe-secret-value-42", "GITHUB_TOKEN": "ghp_" + "Z9y8X7w6V5" * 4,
    "SOME_KEY_BY_SHAPE": "Zq8vN2xLw0Rk7TfY4bHc9sJm1PdG6uEa", "DATABASE_URL": "postgres://app:pw123456@db/x",
    "OPENAI_API_KEY": "sk-" + "proj" * 10, "SLACK_WEBHOOK": "https://hooks.slack.com/services/T0/B0/xyz",
}


def result() -> MetricsTail:
    records = [{"step": i, "loss": 5.0 - i / 100, "lr": 3e-4, "grad_norm": 1.2, "tokens_per_s": 12345.6,
                "note": f"step {i} ok"} for i in range(200)]
    return MetricsTail(run_id="20260101-000000-lm-abcd", status="running", records=records, truncated=False)


def timed(fn, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    start = time.perf_counter()
    redaction.reload(ENVIRONMENT)
    compile_ms = (time.perf_counter() - start) * 1000
    model = result()
    console = ("step 12 loss 3.2 tokens/s 12000\n" * 700)[:20_000]
    print(f"compiling the redactor: {compile_ms:.2f} ms (once per server start); result: "
          f"{len(model.model_dump_json()):,} characters + {len(console):,} of console text")
    redacts, serializes = [], []
    for round_ in range(args.rounds):
        r = timed(lambda: (redaction.redact_model(model), redaction.redact(console)), args.repeats)
        s = timed(lambda: (model.model_dump_json(), console.encode()), args.repeats)
        redacts.append(r)
        serializes.append(s)
        print(f"round {round_ + 1}: redaction {r * 1000:.2f} ms, serialization {s * 1000:.2f} ms, ratio {r / s:.2f}x")
    r, s = statistics.median(redacts), statistics.median(serializes)
    print(f"median: redaction {r * 1000:.2f} ms vs serialization {s * 1000:.2f} ms: {r / s:.2f}x "
          f"(goal: under 1 ms: {'met' if r < 1e-3 else 'NOT met'})")


if __name__ == "__main__":
    main()
