"""A run's speed has one definition (engine.run_metrics.run_speed): the mean over its training steps
after the warm-up window, and the last window's, each named as what it is wherever it is shown."""

from __future__ import annotations

import json

import pytest

from engine import run_dir as rd
from engine import run_metrics
from runner.supervise import run_note
from tests.sandbox.helpers import fake_run, make_workspace

# A run whose warm-up window is slow and whose last window is fast: steps 1-5 at 500 tokens/s,
# 6-10 at 1,000 (1 s a step), 11-30 at 250 (4 s a step), the last window 10,000 (0.1 s a step).
WINDOWS = [(5, 500.0, 2.0), (10, 1000.0, 1.0), (15, 250.0, 4.0), (20, 250.0, 4.0), (25, 250.0, 4.0),
           (30, 10000.0, 0.1)]


def records() -> list[dict]:
    out = []
    for step, speed, step_time in WINDOWS:
        out.append({"step": step, "loss": 1.0, "tokens_per_s": speed, "step_time_s": step_time})
        out.append({"step": step, "eval_loss": 2.0})  # an evaluation: not a training window
    return out


def expected_mean() -> float:
    measured = WINDOWS[1:]
    seconds = sum(5 * t for _, _, t in measured)
    return sum(5 * t * s for _, s, t in measured) / seconds


def test_the_mean_is_tokens_over_time_after_the_warm_up_window():
    speed = run_metrics.run_speed(records())
    assert speed is not None
    assert speed.mean_tokens_per_s == pytest.approx(expected_mean())
    assert speed.mean_tokens_per_s == pytest.approx(5 * (1000 * 1 + 3 * 250 * 4 + 10000 * 0.1) / 65.5)
    assert speed.last_window_tokens_per_s == 10000.0
    assert (speed.warmup_steps, speed.measured_steps) == (5, 25)
    text = speed.describe()
    assert text == (f"mean {expected_mean():,.0f} tokens/s over 25 step(s) (first 5 step(s) of warm-up excluded); "
                    "last window 10,000 tokens/s")


def test_one_window_is_its_own_mean_and_says_the_warm_up_is_in_it():
    speed = run_metrics.run_speed([{"step": 4, "tokens_per_s": 300.0, "step_time_s": 0.5}])
    assert speed is not None and speed.mean_tokens_per_s == 300.0 and speed.warmup_steps == 0
    assert "includes it" in speed.describe()


def test_no_training_record_no_speed_and_run_output_cannot_break_it():
    assert run_metrics.run_speed([]) is None
    assert run_metrics.run_speed([{"step": 3, "loss": 1.0}]) is None
    hostile = [{"step": 1, "tokens_per_s": "inf", "step_time_s": 1.0}, {"step": 2, "tokens_per_s": 10**400,
               "step_time_s": 1.0}, {"step": "3", "tokens_per_s": 1.0, "step_time_s": 1.0},
               {"step": 4, "tokens_per_s": -5.0, "step_time_s": 1.0}]
    assert run_metrics.run_speed(hostile) is None


def test_a_resumed_run_counts_its_first_window_from_the_step_it_resumed_after():
    speed = run_metrics.run_speed([{"step": 25, "tokens_per_s": 100.0, "step_time_s": 1.0},
                          {"step": 30, "tokens_per_s": 200.0, "step_time_s": 1.0}], start_step=20)
    assert speed is not None and (speed.warmup_steps, speed.measured_steps) == (5, 5)


def write_windows(run_dir):
    with open(run_dir / rd.METRICS_JSONL, "w") as f:
        for record in records():
            f.write(json.dumps(record) + "\n")


def test_the_git_note_gives_the_mean_and_the_last_window_by_name(tmp_path):
    root = make_workspace(tmp_path / "ws")
    run_dir = fake_run(root, "20260101-000000-lm-speed")
    write_windows(run_dir)
    record = rd.read_run(run_dir)
    note = run_note(record, run_metrics.latest_metrics(run_dir / rd.METRICS_JSONL), run_metrics.read_run_speed(run_dir, record))
    assert f"; mean {expected_mean():,.0f} tokens/s over 25 step(s) (first 5 step(s) of warm-up excluded); " \
           "last window 10,000 tokens/s; " in note
    assert "; 10,000 tokens/s" not in note  # the last window is never given as the run's speed


def test_get_run_and_list_runs_give_both_speeds(tmp_path):
    from mcp_server.operations import runs
    from workspace.workspace import Workspace

    root = make_workspace(tmp_path / "ws")
    write_windows(fake_run(root, "20260101-000000-lm-speed"))
    ws = Workspace(root)
    info = runs.get_run(ws, "20260101-000000-lm-speed")
    assert info.speed == run_metrics.run_speed(records()).describe()
    assert info.speed.startswith(f"mean {expected_mean():,.0f} tokens/s over 25 step(s)")
    assert info.speed.endswith("last window 10,000 tokens/s")
    summary = runs.list_runs(ws).runs[0]
    assert summary.mean_tokens_per_s == round(expected_mean(), 1)
    assert summary.last_window_tokens_per_s == 10000.0


def test_review_names_the_mean_and_the_last_window(tmp_path):
    from mcp_server.models import ReviewCommit, ReviewResult
    from mcp_server.operations import review
    from workspace.workspace import Workspace

    root = make_workspace(tmp_path / "ws")
    write_windows(fake_run(root, "20260101-000000-lm-speed", git_commit="a" * 40))
    runs = review._runs_by_commit(Workspace(root))["a" * 40]
    assert runs[0].mean_tokens_per_s == pytest.approx(expected_mean())
    assert runs[0].last_window_tokens_per_s == 10000.0
    commit = ReviewCommit(sha="a" * 40, subject="s", tool="apply_skill", files_changed=1, insertions=1,
                          deletions=0, runs=runs)
    text = review.format_review(ReviewResult(base=None, commits=[commit]))
    assert (f"run 20260101-000000-lm-speed: completed at step 30, loss 1.0000, mean {expected_mean():,.0f} "
            "tokens/s over 25 step(s) (first 5 step(s) of warm-up excluded); last window 10,000 tokens/s") in text


def test_a_window_counts_its_training_steps_only_not_the_evaluations_and_saves_inside_it(monkeypatch):
    """Steps take 1 s, an evaluation 50 s (a compiled model compiles its evaluation graphs
    first), a save 30 s; evaluations every 2 steps, saves every 3, a window every 4: each window
    is its 4 steps' 4 seconds, whatever falls inside it."""
    from types import SimpleNamespace

    import engine.engine as engine_module
    from engine.engine import Engine

    clock = [0.0]
    monkeypatch.setattr(engine_module.time, "perf_counter", lambda: clock[0])
    windows: list[tuple[float, int, int]] = []

    def train_step():
        clock[0] += 1.0
        fake.state.step += 1
        return SimpleNamespace(num_tokens=100, num_loss_tokens=60, num_positions=128)

    def evaluate():
        clock[0] += 50.0
        return 1.0

    def save_checkpoint():
        clock[0] += 30.0

    config = SimpleNamespace(train=SimpleNamespace(max_steps=12, log_every=4, eval_every=2),
                             checkpoint=SimpleNamespace(every=3))
    fake = SimpleNamespace(
        config=config, state=SimpleNamespace(step=0), model=SimpleNamespace(train=lambda: None),
        train_step=train_step, evaluate=evaluate, save_checkpoint=save_checkpoint, eval_batches=[{}],
        logger=SimpleNamespace(log=lambda record: None), _synchronize=lambda: None,
        log_step=lambda ctx, window: windows.append((window.elapsed, window.tokens, window.steps)),
    )
    Engine.do_train(fake)
    assert windows == [(4.0, 400, 4)] * 3
