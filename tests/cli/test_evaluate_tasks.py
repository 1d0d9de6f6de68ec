"""lm-eval's scores as `evaluate(tasks=...)` answers them: cut to the agent's budget, saying how
many were left out, and as `trainwright evaluate RUN --task NAME` prints them: a line per task,
each metric with its stderr where lm-eval gives one, the example count, then the warnings."""

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


def test_task_scores_are_cut_to_the_agent_budget_saying_how_many_were_left_out():
    from engine.seams import MAX_METRICS, MAX_TASK_SCORES, TaskScore
    from mcp_server.limits import AGENT_BUDGET_CHARS, json_chars
    from mcp_server.operations.model_tools import bounded_task_scores

    metrics = {f"metric_{i:02d}" + "x" * 20: 0.123456789 for i in range(MAX_METRICS // 4)}
    scores = [TaskScore(task=f"sub_{i:02d}", examples=100, metrics=metrics, stderr=metrics)
              for i in range(MAX_TASK_SCORES)]
    kept, left_out = bounded_task_scores(scores)
    assert 0 < len(kept) < MAX_TASK_SCORES and left_out == MAX_TASK_SCORES - len(kept)
    assert list(kept) == [f"sub_{i:02d}" for i in range(len(kept))]  # lm-eval's order, the first ones
    assert json_chars(kept) < AGENT_BUDGET_CHARS - 1500
    small = [TaskScore(task="code_mc", examples=12, metrics={"acc": 0.25}, stderr={"acc": 0.13})]
    assert bounded_task_scores(small) == ({"code_mc": {"examples": 12, "metrics": {"acc": 0.25},
                                                       "stderr": {"acc": 0.13}}}, 0)
