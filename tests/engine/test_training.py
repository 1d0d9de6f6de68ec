"""The engine really trains, on one process and on two, and resumes bit for bit after a kill.

One uninterrupted single-process run is the reference; every other run in this file is
compared with it step by step.
"""

from __future__ import annotations

import os
import random
import signal

import pytest

from engine import run_dir as rd
from engine import run_checkpoints
from engine import run_metrics
from tests.support import (
    TINY,
    copy_template,
    kill_group,
    losses,
    run_engine,
    start_engine,
    wait_for,
)

STEPS = 16
SCHEDULE = (*TINY, f"train.max_steps={STEPS}", "checkpoint.every=4", "checkpoint.keep_last=10")


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine")
    return root, copy_template(root)


@pytest.fixture(scope="module")
def reference(workspace):
    root, recipe = workspace
    return run_engine(root, recipe, *SCHEDULE)


def test_a_run_writes_the_run_directory_of_the_contract(reference):
    record = rd.read_run(reference)
    assert record.status == rd.COMPLETED
    assert record.world_size == 1
    assert record.config["train"]["max_steps"] == STEPS
    assert [s for s, _ in run_checkpoints.list_checkpoints(reference)] == [4, 8, 12, 16]
    first = run_metrics.read_all_metrics(reference / rd.METRICS_JSONL)[0]
    for key in ("step", "loss", "lr", "grad_norm", "tokens_per_s", "loss_tokens_per_s", "step_time_s", "peak_mem_mb",
                "data_s", "fwd_bwd_s", "optim_s", "rss_peak_mb"):
        assert key in first, key
    for record in run_metrics.read_all_metrics(reference / rd.METRICS_JSONL):
        if "loss" in record:  # on a CPU, the busiest process's peak is its resident set's
            assert len(record["rss_peak_mb"]) == 1 and record["peak_mem_mb"] == max(record["rss_peak_mb"])
            assert "cuda_max_allocated_mb" not in record


def test_loss_falls(reference):
    curve = losses(reference)
    assert sorted(curve) == list(range(1, STEPS + 1))
    start = sum(curve[s] for s in (1, 2, 3)) / 3
    end = sum(curve[s] for s in (STEPS - 2, STEPS - 1, STEPS)) / 3
    assert end < 0.8 * start, (start, end)


def test_keep_last_prunes_old_checkpoints(workspace):
    root, recipe = workspace
    run = run_engine(root, recipe, *TINY, "train.max_steps=6", "checkpoint.every=2", "checkpoint.keep_last=2")
    assert [s for s, _ in run_checkpoints.list_checkpoints(run)] == [4, 6]
    leftovers = [p.name for p in (run / rd.CHECKPOINTS_DIRNAME).iterdir() if p.name.startswith(".")]
    assert leftovers == []


# The default model: its steps (~0.2 s) are slow enough to kill at a chosen step, and its
# checkpoint (~36 MB) takes long enough to be caught mid-save.
DEFAULT_SIZE = (*SCHEDULE, "model.hidden_size=256", "model.intermediate_size=688", "model.num_layers=4",
                "train.max_steps=10", "checkpoint.every=2")


@pytest.fixture(scope="module")
def default_size_reference(workspace):
    root, recipe = workspace
    return run_engine(root, recipe, *DEFAULT_SIZE)


def test_sigkill_at_a_random_step_then_resume_is_bit_identical(workspace, default_size_reference):
    root, recipe = workspace
    kill_after = random.Random(os.getpid()).randint(3, 8)
    process, run = start_engine(root, recipe, *DEFAULT_SIZE)
    wait_for(lambda: max(losses(run), default=0) >= kill_after, timeout=300, interval=0.005)
    kill_group(process)

    last_logged = max(losses(run))
    assert last_logged < 10, "the kill landed before the run finished"
    step, checkpoint = run_checkpoints.latest_checkpoint(run)
    assert step <= last_logged
    resumed = run_engine(root, recipe, *DEFAULT_SIZE, resume_from=checkpoint)

    expected = {s: v for s, v in losses(default_size_reference).items() if s > step}
    assert losses(resumed) == expected, f"killed after step {last_logged}, resumed from {step}"


def test_a_kill_during_a_checkpoint_save_leaves_it_ignored_and_resume_is_bit_identical(
    workspace, default_size_reference
):
    root, recipe = workspace
    process, run = start_engine(root, recipe, *DEFAULT_SIZE)
    partial = run / rd.CHECKPOINTS_DIRNAME / (run_checkpoints.PARTIAL_PREFIX + run_checkpoints.checkpoint_dir_name(6))
    wait_for(partial.exists, timeout=300, interval=0.001)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()

    assert partial.exists(), "the kill landed while step 6 was being saved"
    assert [s for s, _ in run_checkpoints.list_checkpoints(run)] == [2, 4], "the half-written checkpoint is not listed"
    resumed = run_engine(root, recipe, *DEFAULT_SIZE, resume_from=run_checkpoints.latest_checkpoint(run)[1])
    assert losses(resumed) == {s: v for s, v in losses(default_size_reference).items() if s > 4}


@pytest.mark.multiprocess
def test_two_processes_match_one_and_their_checkpoint_resumes_on_one(workspace, reference):
    root, recipe = workspace
    two = run_engine(root, recipe, *SCHEDULE, nproc=2)
    assert rd.read_run(two).world_size == 2
    peaks = [r["rss_peak_mb"] for r in run_metrics.read_all_metrics(two / rd.METRICS_JSONL) if "loss" in r]
    assert peaks and all(len(p) == 2 and all(mb > 50 for mb in p) for p in peaks)  # each process's own
    one_curve, two_curve = losses(reference), losses(two)
    assert sorted(two_curve) == sorted(one_curve)
    relative = {s: abs(two_curve[s] - one_curve[s]) / abs(one_curve[s]) for s in one_curve}
    print(f"\n2 vs 1 process: max relative loss difference {max(relative.values()):.1e} over {STEPS} steps")
    assert max(relative.values()) <= 1e-4, relative

    checkpoint = dict(run_checkpoints.list_checkpoints(two))[8]
    resharded = run_engine(root, recipe, *SCHEDULE, resume_from=checkpoint)
    resumed_curve = losses(resharded)
    assert sorted(resumed_curve) == list(range(9, STEPS + 1))
    for step, value in resumed_curve.items():
        assert abs(value - one_curve[step]) <= 1e-4 * abs(one_curve[step]), step


def test_by_default_batches_end_at_their_last_label_with_the_same_curve_and_resume_bit_for_bit(workspace):
    root, recipe = workspace
    words = "the quick brown fox jumps over a lazy dog".split()
    rng = random.Random(0)
    (root / "short.jsonl").write_text("".join(
        '{"text": "%s"}\n' % " ".join(rng.choice(words) for _ in range(rng.randint(2, 12))) for _ in range(200)))
    short = (*TINY, "data.paths=[short.jsonl]", "train.max_steps=8", "checkpoint.every=4", "train.log_every=1")
    padded = run_engine(root, recipe, *short, "data.pad_to_longest=false")  # rows of data.seq_len
    longest = run_engine(root, recipe, *short)  # unset, eager: each batch ends at its last label
    resumed = run_engine(root, recipe, *short, resume_from=dict(run_checkpoints.list_checkpoints(longest))[4])

    assert losses(resumed) == {s: v for s, v in losses(longest).items() if s > 4}
    assert losses(longest) == pytest.approx(losses(padded), rel=1e-4)  # the same math, rounded elsewhere
    padding = {run: [r["padding_frac"] for r in run_metrics.read_all_metrics(run / rd.METRICS_JSONL) if "loss" in r]
               for run in (padded, longest)}
    pairs = list(zip(padding[longest], padding[padded]))  # step by step: the same batches
    assert all(cut <= whole for cut, whole in pairs) and sum(cut for cut, _ in pairs) < 0.8 * sum(w for _, w in pairs)
