"""How `trainwright evaluate RUN --task NAME` prints lm-eval's scores: a line per task, each
metric with its stderr where lm-eval gives one, the example count, then the warnings."""

from __future__ import annotations

from mcp_server.models import EvaluateResult
from mcp_server.terminal import evaluate_text


def test_task_scores_print_a_line_per_task_with_stderr_and_counts():
    result = EvaluateResult(run_id="20260101-000000-lm-0001", step=6, eval_loss=None, split="tasks", metrics={}, tasks={
        "code_mc": {"examples": 12, "metrics": {"acc": 0.25, "acc_norm": 0.75},
                    "stderr": {"acc": 0.1305582, "acc_norm": 0.1305582}},
        "group": {"examples": None, "metrics": {"exact_match,strict-match": 0.5}, "stderr": {}},
    }, warnings=["scores are over 12 example(s) of a task given, fewer than 30"])
    assert evaluate_text(result) == (
        "run 20260101-000000-lm-0001 step 6: lm-eval\n"
        "  code_mc (12 examples): acc 0.25 ± 0.13, acc_norm 0.75 ± 0.13\n"
        "  group: exact_match,strict-match 0.5\n"
        "warning: scores are over 12 example(s) of a task given, fewer than 30")
