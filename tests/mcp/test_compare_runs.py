"""compare_runs: differences in config and code, then a verdict per metric at the noise of the
runs' own windows.

The verdict rules are checked on plain numbers; real runs (a module's worth, trained once) check
what the runs share and what is left out, the bit-equal losses of gradient checkpointing and its
lower peak memory. Speed verdicts of real runs depend on the machine's load: bench/compare_runs.py
prints them.
"""

from __future__ import annotations

import json

import pytest

from mcp_server import cli
from mcp_server.operations import compare
from mcp_server.operations import recipes as recipe_ops
from mcp_server.operations import launch as launching
from workspace.workspace import Workspace
from tests.mcp.conftest import connect
from tests.skills.skill_helpers import write_documents
from tests.support import TINY, finished_run

# Activations dominate the peak: 16 × 256 positions through 6 layers of the tiny width.
HEAVY = (*TINY, "model.num_layers=6", "data.seq_len=256", "data.batch_size=16", "train.max_steps=4",
         "checkpoint.every=0", "checkpoint.at_end=false", "metrics.tensorboard=false")


# ---------------------------------------------------------------------------------------------
# The rules, on numbers
# ---------------------------------------------------------------------------------------------


def test_speeds_inside_each_others_spread_are_no_difference():
    verdict = compare.compare_windows("tokens_per_s", [1000, 1100, 900, 1050], [1040, 960, 1100, 1000], True)
    assert verdict.verdict == "no difference"
    assert verdict.a == 1025 and verdict.b == 1020
    assert "noise bound ±" in verdict.evidence


def test_a_speed_beyond_the_spread_is_better_with_its_ratio():
    verdict = compare.compare_windows("tokens_per_s", [1000, 1010, 990, 1000], [1500, 1490, 1510, 1500], True)
    assert (verdict.verdict, verdict.ratio) == ("better", 1.5)
    slower = compare.compare_windows("step_time_s", [0.10, 0.10, 0.11], [0.13, 0.13, 0.14], False)
    assert slower.verdict == "worse"


def test_one_window_after_the_warm_up_is_not_enough_for_a_verdict():
    verdict = compare.compare_windows("tokens_per_s", [1000], [2000, 2100], True)
    assert verdict.verdict == "not compared"
    assert verdict.evidence.startswith("1 and 2 window(s) after the warm-up")
    assert verdict.evidence.endswith("(log more often: train.log_every)")
    script = compare.compare_windows("tokens_per_s", [1000], [2000, 2100], True, kind="script")
    assert script.evidence.endswith("(the script's metric lines are its windows: print one more often)")


def test_bit_equal_loss_curves_say_so():
    curve = [(100.0, 5.0), (200.0, 4.0), (300.0, 3.5)]
    verdict = compare.compare_curves("loss", curve, list(curve))
    assert verdict is not None and verdict.verdict == "no difference"
    assert verdict.evidence == "bit-equal over 100-300 tokens seen (16 grid points)"


def test_losses_are_compared_at_equal_tokens_seen_not_at_equal_steps():
    # b sees twice the tokens per record (packed rows): at equal tokens its curve is a's.
    a = [(float(t), 6.0 - t / 100) for t in range(100, 900, 100)]
    b = [(float(t), 6.0 - t / 100) for t in range(200, 1800, 200)]
    verdict = compare.compare_curves("loss", a, b)
    assert verdict is not None and verdict.verdict == "no difference"
    assert "200-800 tokens seen" in verdict.evidence
    lower = compare.compare_curves("loss", a, [(t, v - 0.5) for t, v in a])
    assert lower is not None and lower.verdict == "better" and lower.b == pytest.approx(lower.a - 0.5)  # type: ignore[operator]


def test_a_higher_reward_is_better():
    a = [(float(t), t / 1000) for t in range(100, 900, 100)]
    higher = compare.compare_curves("reward", a, [(t, v + 0.5) for t, v in a], higher_is_better=True)
    assert higher is not None and higher.verdict == "better" and higher.b == pytest.approx(higher.a + 0.5)  # type: ignore[operator]
    lower = compare.compare_curves("reward", a, [(t, v - 0.5) for t, v in a], higher_is_better=True)
    assert lower is not None and lower.verdict == "worse"


def test_peak_memory_within_the_noise_is_no_difference_and_names_each_process():
    assert compare.compare_peaks((1000.0, [1000.0]), (1020.0, [1020.0])).verdict == "no difference"
    lower = compare.compare_peaks((1000.0, [990.0, 1000.0]), (700.0, [690.0, 700.0]))
    assert (lower.verdict, lower.ratio) == ("better", 0.7)
    assert "RSS per process [990, 1,000] MB vs [690, 700] MB" in lower.evidence


def test_a_sides_runs_pool_into_one_curve_bit_equal_ones_unchanged():
    curve = [(100.0, 5.1), (200.0, 4.3), (300.0, 3.7)]
    assert compare._pooled_curve([curve, list(curve), list(curve)]) == curve  # not (3·y)/3: still bit-equal
    other = [(150.0, 4.9), (250.0, 4.1), (350.0, 3.0)]
    assert compare._pooled_curve([curve, other]) == [(150.0, pytest.approx((4.7 + 4.9) / 2)),
                                                      (200.0, pytest.approx((4.3 + 4.5) / 2)),
                                                      (250.0, pytest.approx((4.0 + 4.1) / 2)),
                                                      (300.0, pytest.approx((3.7 + 3.55) / 2))]
    assert compare._pooled_curve([curve, []]) == []


# ---------------------------------------------------------------------------------------------
# Real runs
# ---------------------------------------------------------------------------------------------


def test_a_run_faster_per_step_but_slower_to_start_is_said_slower_for_its_length():
    """torch-compile on a short run: steps 0.8× as long, 65 s of compilation in a 92 s job."""
    steady = compare.compare_windows("step_time_s", [0.100, 0.101, 0.099], [0.080, 0.081, 0.079], False)
    first = compare.compare_totals("first_step_s", [2.0], [65.0], "first step")
    wall = compare.compare_totals("wall_s", [30.0], [92.0], "launch to end")
    assert (steady.verdict, first.verdict, wall.verdict) == ("better", "worse", "worse")
    assert wall.ratio == pytest.approx(3.0667, rel=1e-3) and "one run each, noise bound ±15%" in wall.evidence
    assert compare.compare_totals("wall_s", [30.0], [33.0], "").verdict == "no difference"  # inside one run's noise
    # Several runs a side: their own spread widens the bound.
    assert compare.compare_totals("wall_s", [30.0, 40.0], [44.0, 46.0], "").evidence.endswith("2 and 2 runs, noise bound ±17%")


def test_steps_to_a_loss_are_counted_to_the_higher_final_loss_at_the_logging_resolution():
    a = [(10, 3.0, 1.0), (20, 2.0, 2.0), (30, 1.5, 3.0), (40, 1.25, 4.0), (50, 1.0, 5.0), (60, 0.75, 6.0)]
    b = [(10, 2.0, 1.5), (20, 1.5, 3.0), (30, 1.0, 4.5), (40, 0.75, 6.0), (50, 0.5, 7.5), (60, 0.25, 9.0)]
    verdict = compare.compare_steps_to_loss(a, b)
    assert verdict is not None  # a's final loss (1.0) is the higher: a reaches it at 50, b at 30
    assert (verdict.a, verdict.b, verdict.verdict) == (50, 30, "better")
    assert "(at 5.0 s and 4.5 s)" in verdict.evidence and "resolution ±10 steps" in verdict.evidence
    near = [(step + 10, loss, None) for step, loss, _ in a]
    assert compare.compare_steps_to_loss(a, near).verdict == "no difference"  # one logging interval later
    assert compare.compare_steps_to_loss(a[:2], b) is None


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Workspace, dict[str, str]]:
    root = tmp_path_factory.mktemp("compare")
    ws = Workspace.open(root)
    recipe_ops.scaffold_recipe(ws, "causal_lm", "plain")
    recipe_ops.scaffold_recipe(ws, "causal_lm", "ckpt", skills=["gradient-checkpointing"])
    docs = write_documents(root / "docs.jsonl", 200, 5, 60)
    ids = {}
    for name, recipe, extra in (("plain", "plain", ()), ("seed", "plain", ("train.seed=7",)),
                                ("ckpt", "ckpt", ()),
                                ("docs", "plain", ("data.source=files", f"data.paths=[{docs}]"))):
        ids[name] = finished_run(ws, launching.launch_run(ws, f"recipes/{recipe}", 1, [*HEAVY, *extra]).run_id)
    return ws, ids


def verdicts(result) -> dict[str, str]:
    return {m.metric: m.verdict for m in result.metrics}


def test_gradient_checkpointing_keeps_the_losses_bit_equal_and_lowers_the_peak(runs):
    ws, ids = runs
    result = compare.compare_runs(ws, ids["plain"], ids["ckpt"])
    assert result.differences[0] == "recipe: recipes/plain → recipes/ckpt"
    assert any(d.startswith("skills: only a: none; only b: gradient-checkpointing@") for d in result.differences)
    by_metric = {m.metric: m for m in result.metrics}
    assert by_metric["loss"].verdict == "no difference" and by_metric["loss"].evidence.startswith("bit-equal")
    assert by_metric["peak_mem_mb"].verdict == "better"
    assert by_metric["peak_mem_mb"].ratio is not None and by_metric["peak_mem_mb"].ratio < 0.95  # 0.88-0.90 measured
    assert set(by_metric) == {"loss", "tokens_per_s", "step_time_s", "peak_mem_mb", "first_step_s", "wall_s",
                              "steps_to_loss"}
    assert by_metric["steps_to_loss"].verdict == "no difference" and by_metric["steps_to_loss"].a == by_metric[
        "steps_to_loss"].b  # bit-equal losses reach every loss at the same step
    assert by_metric["wall_s"].a > by_metric["first_step_s"].a > 0
    assert result.left_out == ["eval_loss: not logged by both runs over common tokens"]


def test_runs_that_differ_in_seed_differ_in_that_key_only(runs):
    ws, ids = runs
    result = compare.compare_runs(ws, ids["plain"], ids["seed"])
    assert result.differences == ["train.seed: 0 → 7"]
    assert verdicts(result)["loss"] in ("no difference", "better", "worse")  # compared: same data


def test_runs_on_other_data_leave_the_loss_out_and_say_why(runs):
    ws, ids = runs
    result = compare.compare_runs(ws, ids["plain"], ids["docs"])
    assert "loss" not in verdicts(result) and "tokens_per_s" in verdicts(result)
    assert result.left_out[0].startswith("loss, eval_loss: different data")
    assert any(d.startswith("data.source: ") for d in result.differences)


def test_the_cli_twin_prints_the_same_object(runs, capsys):
    ws, ids = runs
    code = cli.main(["compare", ids["plain"], ids["ckpt"], "--workspace", str(ws.root), "--json"])
    printed = json.loads(capsys.readouterr().out)
    assert code == 0
    assert printed == json.loads(compare.compare_runs(ws, ids["plain"], ids["ckpt"]).model_dump_json())
    assert len(json.dumps(printed)) < 8_000
    assert cli.main(["compare", ids["plain"], "no-such-run", "--workspace", str(ws.root)]) == 3



def test_the_tool_answers_through_mcp(runs):
    ws, ids = runs
    with connect("memory", ws.root) as session:
        answer = session.ok("compare_runs", run_a=ids["plain"], run_b=ids["seed"])
    assert answer["differences"] == ["train.seed: 0 → 7"]
    assert [m["metric"] for m in answer["metrics"]] == ["loss", "tokens_per_s", "step_time_s", "peak_mem_mb",
                                                        "first_step_s", "wall_s", "steps_to_loss"]
