"""A script's TensorBoard event files cannot defeat its limits: the supervisor reads them on a
thread of their own, one look reads a bounded number of events, and a step keeps a bounded
number of tags. Scalars written as tensors (``add_scalar(new_style=True)``, Keras, JAX) are read;
a scalar tensor that cannot be is said once, not dropped silently."""

from __future__ import annotations

import io
import json
import struct
import sys
import time
from pathlib import Path

from engine import run_dir as rd
from runner import scripts
from runner.processes import end_processes, marked
from runner.tensorboard_events import MAX_EVENTS_PER_LOOK, EventFiles, event_scalars
from tests.sandbox.helpers import (
    make_workspace, protobuf_field, scalar_event, supervise, tensor_event, wait_final,
)


def test_one_look_reads_a_bounded_number_of_events_and_a_step_keeps_a_bounded_number_of_tags(tmp_path):
    events = tmp_path / "events.out.tfevents.1"
    events.write_bytes(b"".join(scalar_event(1, f"t{i}", 1.0) for i in range(MAX_EVENTS_PER_LOOK * 3)))
    out = io.BytesIO()
    scalars = scripts.EventScalars(tmp_path, scripts.ScriptMetrics(out))
    scalars.poll()
    assert len(scalars.pending) == scripts.MAX_METRIC_KEYS + 1  # step, and the first tags
    first = scalars.files.offsets[events]
    assert 0 < first < events.stat().st_size  # the rest waits for the next look
    scalars.poll()
    assert scalars.files.offsets[events] > first
    for _ in range(10):
        scalars.poll()
    scalars.poll(final=True)
    (line,) = out.getvalue().splitlines()
    written = json.loads(line)
    assert written["step"] == 1 and len(written) == scripts.MAX_METRIC_KEYS + 1
    assert EventFiles(tmp_path).new_scalars()[:1] == [(1, {"t0": 1.0})]  # a fresh reader starts again


def test_scalars_written_as_tensors_are_read_and_an_unreadable_one_is_said_once(tmp_path, capsys):
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path / "tb"))
    writer.add_scalar("loss", 0.5, 1, new_style=True)
    writer.add_scalar("loss", 0.25, 2, new_style=True, double_precision=True)
    writer.close()
    dt_double_content = b"\x08\x02" + protobuf_field(4, struct.pack("<d", 0.125))   # tf.summary.scalar, float64
    dt_float_val = b"\x08\x01" + b"\x2d" + struct.pack("<f", 2.0)          # one float_val
    dt_int32 = b"\x08\x03" + b"\x38\x07"                                   # an int32: not read
    (tmp_path / "zz").mkdir()  # read after tb/: its steps come later
    (tmp_path / "zz" / "events.out.tfevents.2").write_bytes(
        tensor_event(3, "lr", dt_double_content) + tensor_event(4, "lr", dt_float_val)
        + tensor_event(5, "count", dt_int32) + tensor_event(5, "note", b"\x08\x07", plugin="text"))
    assert event_scalars(tensor_event(5, "count", dt_int32)[12:-4]) == (5, {"\0unread": 1})
    out = io.BytesIO()
    scalars = scripts.EventScalars(tmp_path, scripts.ScriptMetrics(out))
    scalars.poll()
    scalars.poll(final=True)
    records = [json.loads(line) for line in out.getvalue().splitlines()]
    assert records == [{"step": 1, "loss": 0.5}, {"step": 2, "loss": 0.25}, {"step": 3, "lr": 0.125},
                       {"step": 4, "lr": 2.0}]
    assert capsys.readouterr().out.count("is a tensor that is not one float or double") == 1
    assert scalars.unread == 1


HOSTILE = f"""
import os, signal, struct, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})
from tests.sandbox.helpers import scalar_event
os.makedirs("logs", exist_ok=True)
files = [open(f"logs/events.out.tfevents.{{i}}", "ab") for i in range(16)]
tag = 0
print("STARTED", flush=True)
while True:
    for f in files:
        f.write(b"".join(scalar_event(1, f"tag{{tag + i}}", 1.0) for i in range(5000)))
        f.flush()
        tag += 5000
"""


def test_a_script_flooding_event_files_and_ignoring_sigterm_ends_at_its_wall_time_limit(tmp_path):
    workspace = make_workspace(tmp_path / "ws")
    run_dir = workspace / rd.RUNS_DIRNAME / "20260101-000000-flood-0000"
    started = time.monotonic()
    process = supervise(run_dir, [sys.executable, "-c", HOSTILE], {"wall_time_s": 4, "stop_grace_s": 2},
                        run_id=run_dir.name, kind=rd.SCRIPT, script="flood.py", timeout=120)
    try:
        process.wait(timeout=60)
    finally:
        process.kill()
        end_processes(marked(run_dir.name), grace_s=0)  # whatever a failure left behind
    elapsed = time.monotonic() - started
    record = wait_final(run_dir, timeout=10)
    assert record.status == rd.STOPPED and "wall-time limit of 4 s reached" in (record.reason or ""), record
    assert elapsed < 30, f"the run ended {elapsed:.0f} s after it started, under a wall-time limit of 4 s"
