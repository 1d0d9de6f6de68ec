"""A script's output as metrics: untrusted input read by the supervisor outside the sandbox
(runner/scripts.py). Lines are bounded, only finite numbers are kept, records are bounded in
number, and a link planted at metrics.jsonl is never written through."""

from __future__ import annotations

import io
import json
import math
import os

import pytest

from engine import run_dir as rd
from runner import scripts
from runner.processes import RUN_ID_VARIABLE
from tests.support import untimed

import trainwright


def test_a_json_line_with_an_integer_step_is_a_record_of_its_finite_numbers():
    line = json.dumps({"step": 7, "loss": 2.5, "acc": 1, "name": "x", "nested": {"a": 1}, "flag": True,
                       "big": 10**400, "bad key": 1.0, "lr": 3e-4}).encode()
    assert scripts.parse_metric_line(line) == {"step": 7, "loss": 2.5, "acc": 1, "lr": 3e-4}


def test_lines_that_are_not_metrics_records_are_console_output_only():
    for line in (b"step 3 loss 2.1", b'{"loss": 1.0}', b'{"step": "3", "loss": 1.0}', b'{"step": true, "loss": 1}',
                 b'{"step": -1, "loss": 1}', b'{"step": 3}', b'{"step": 3, "loss": NaN}', b"[1, 2]",
                 b'{"step": 3, "loss": Infinity}', b"{" * 100_000, b'{"step": 10000000000000, "loss": 1}'):
        assert scripts.parse_metric_line(line) is None, line[:60]
    long = json.dumps({"step": 1, "loss": 1.0, "pad": "x" * scripts.MAX_METRIC_LINE_BYTES}).encode()
    assert scripts.parse_metric_line(long) is None


def test_a_record_keeps_at_most_so_many_keys():
    line = json.dumps({"step": 1, **{f"k{i}": i for i in range(100)}}).encode()
    assert len(scripts.parse_metric_line(line)) == scripts.MAX_METRIC_KEYS + 1


def test_records_are_appended_in_order_once_each_and_bounded_in_number(monkeypatch):
    out = io.BytesIO()
    metrics = scripts.ScriptMetrics(out)
    for line in (b'{"step": 1, "loss": 3.0}', b'{"step": 1, "loss": 3.0}', b'{"step": 2, "loss": 2.0}',
                 b'{"step": 1, "loss": 9.0}', b'{"step": 2, "tokens_seen": 1.5, "loss": 1.5}'):
        metrics.feed(line)
    records = [json.loads(x) for x in out.getvalue().splitlines()]
    assert [untimed(r) for r in records] == [
        {"step": 1, "loss": 3.0}, {"step": 2, "loss": 1.5}]  # step 2's later values rewrite its one record
    assert all(isinstance(r["elapsed_s"], float) for r in records)
    monkeypatch.setattr(scripts, "MAX_SCRIPT_METRIC_RECORDS", 2)
    assert metrics.feed(b'{"step": 3, "loss": 1.0}') == "[trainwright] 2 metrics records written: later ones are not recorded"
    assert metrics.feed(b'{"step": 4, "loss": 1.0}') is None
    assert len(out.getvalue().splitlines()) == 2


def test_output_is_copied_whole_and_a_long_line_is_never_a_metrics_line():
    long = b'{"step": 5, "loss": 1.0, "pad": "' + b"x" * (3 * scripts.MAX_METRIC_LINE_BYTES) + b'"}\n'
    text = b"hello\n" + long + b'{"step": 6, "loss": 0.5}\n' + b"no newline at the end"
    console, out = io.BytesIO(), io.BytesIO()
    scripts.copy_output(io.BufferedReader(io.BytesIO(text)), console, scripts.ScriptMetrics(out))
    assert console.getvalue() == text
    assert [untimed(json.loads(x)) for x in out.getvalue().splitlines()] == [{"step": 6, "loss": 0.5}]


def test_a_script_that_logs_no_timing_is_timed_by_its_lines(monkeypatch):
    """Each line is stamped with the seconds since the reader started; the time per step between
    two stamped records fills a missing step_time_s; what the script logs itself is kept."""
    clock = iter([100.0, 101.0, 103.0, 104.0, 110.0])
    monkeypatch.setattr(scripts.time, "monotonic", lambda: next(clock))
    out = io.BytesIO()
    metrics = scripts.ScriptMetrics(out)  # started at 100
    for line in (b'{"step": 10, "loss": 3.0}', b'{"step": 20, "loss": 2.0}',
                 b'{"step": 30, "loss": 1.0, "step_time_s": 0.5}', b'{"step": 40, "loss": 0.5, "elapsed_s": 42.0}'):
        metrics.feed(line)
    records = [json.loads(x) for x in out.getvalue().splitlines()]
    assert [r["elapsed_s"] for r in records] == [1.0, 3.0, 4.0, 42.0]
    assert [r.get("step_time_s") for r in records] == [None, 0.2, 0.5, 3.8]


def test_a_link_at_the_metrics_file_is_not_written_through(tmp_path):
    target = tmp_path / "host-file"
    target.write_text("host\n")
    os.symlink(target, tmp_path / rd.METRICS_JSONL)
    assert scripts.open_metrics_for_append(tmp_path / rd.METRICS_JSONL) is None
    assert target.read_text() == "host\n"


def test_args_are_a_bounded_list_of_printable_strings():
    assert scripts.check_args(["--lr", "3e-4", "--name=a b"]) == ["--lr", "3e-4", "--name=a b"]
    assert scripts.check_args(None) == []
    for bad, message in (("--lr 1", "args must be a list of strings"), ([1], "with a non-string item"),
                         (["a\0b"], "control character"), (["x" * 1001], "1001 characters long")):
        try:
            scripts.check_args(bad)
        except scripts.BadInput as e:
            assert message in str(e)
        else:
            raise AssertionError(f"{bad!r} was taken")


def test_track_prints_a_metrics_line_in_a_run_and_nothing_outside(monkeypatch, capsys):
    assert trainwright._RUN_ID_VARIABLE == RUN_ID_VARIABLE  # the mark every run process has
    monkeypatch.delenv(RUN_ID_VARIABLE, raising=False)
    trainwright.track(1, loss=2.0)
    assert capsys.readouterr().out == ""
    monkeypatch.setenv(RUN_ID_VARIABLE, "20260101-000000-x-0000")
    trainwright.track(3, loss=2.0, nan=math.nan, text="no", count=4)
    line = capsys.readouterr().out
    assert json.loads(line) == {"step": 3, "loss": 2.0, "count": 4}
    assert scripts.parse_metric_line(line.encode()) == {"step": 3, "loss": 2.0, "count": 4}
    monkeypatch.setenv("RANK", "1")
    trainwright.track(4, loss=1.0)
    assert capsys.readouterr().out == ""


def test_tensorboard_scalars_are_read_as_records_one_per_step(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    from runner.tensorboard_events import EventFiles

    writer = SummaryWriter(str(tmp_path / "runs" / "exp"))
    for step in (1, 2, 3):
        writer.add_scalar("loss/train", 1.0 / step, step)
        writer.add_scalar("lr", 0.5, step)
    writer.add_text("note", "not a scalar", 3)
    writer.flush()
    out = io.BytesIO()
    scalars = scripts.EventScalars(tmp_path, scripts.ScriptMetrics(out))
    scalars.poll()
    scalars.poll(final=True)
    assert [json.loads(line) for line in out.getvalue().splitlines()] == [
        {"step": 1, "loss_train": 1.0, "lr": 0.5}, {"step": 2, "loss_train": 0.5, "lr": 0.5},
        {"step": 3, "loss_train": pytest.approx(1 / 3, rel=1e-6), "lr": 0.5}]  # TensorBoard keeps float32
    writer.add_scalar("loss/train", 0.25, 4)
    writer.close()
    scalars.poll(final=True)  # only what was written since
    assert json.loads(out.getvalue().splitlines()[-1]) == {"step": 4, "loss_train": 0.25}
    assert EventFiles(tmp_path / "elsewhere").new_scalars() == []


def test_event_files_that_are_links_or_malformed_give_nothing(tmp_path):
    import struct

    from runner.tensorboard_events import EventFiles

    (tmp_path / "outside").mkdir()
    target = tmp_path / "outside" / "events.out.tfevents.1"
    # Event{step: 5, summary: Summary{value: [Value{tag: "x", simple_value: 1.5}]}}
    event = b"\x10\x05" + b"\x2a\x0a" + b"\x0a\x08\x0a\x01x\x15" + struct.pack("<f", 1.5)
    target.write_bytes(struct.pack("<Q", len(event)) + b"\0" * 4 + event + b"\0" * 4)
    assert EventFiles(tmp_path / "outside").new_scalars() == [(5, {"x": 1.5})]
    run = tmp_path / "run"
    run.mkdir()
    os.symlink(target, run / "events.out.tfevents.2")
    (run / "events.out.tfevents.3").write_bytes(struct.pack("<Q", 4) + b"\0" * 4 + b"\x0f\xff\xff\xff" + b"\0" * 4)
    (run / "events.out.tfevents.4").write_bytes(struct.pack("<Q", 1 << 40) + b"\0" * 20)
    assert EventFiles(run).new_scalars() == []


def test_a_summary_at_the_last_step_adds_to_that_steps_record_instead_of_making_a_second(tmp_path):
    """A trainer's end-of-training summary logs at the last step again: one record per step."""
    path = tmp_path / "metrics.jsonl"
    metrics = scripts.ScriptMetrics(scripts.open_metrics_for_append(path))
    for line in (b'{"step": 1, "loss": 2.0}', b'{"step": 2, "loss": 1.5, "lr": 0.1}',
                 b'{"step": 2, "train_loss": 1.75, "train_runtime": 12.5}', b'{"step": 2, "loss": 1.5}'):
        metrics.feed(line)
    assert [untimed(json.loads(line)) for line in path.read_text().splitlines()] == [
        {"step": 1, "loss": 2.0},
        {"step": 2, "loss": 1.5, "lr": 0.1, "train_loss": 1.75, "train_runtime": 12.5},
    ]
    metrics.feed(b'{"step": 3, "loss": 1.25}')
    assert untimed(json.loads(path.read_text().splitlines()[-1])) == {"step": 3, "loss": 1.25}
