"""Readers that survive any run output: a metrics line nested 100k deep, a non-integer step, a
64 MiB unterminated line — list_runs, get_run, tail_metrics, the loss picture and the CLI keep
working, each in bounded time."""

from __future__ import annotations

import json
import time

import pytest

from engine import run_dir as rd
from engine import run_metrics
from mcp_server.server import build_server
from tests.sandbox.helpers import error_text, fake_run, live_client, make_workspace

POISON = {
    "20260101-000001-lm-dee9": '{"step": 9, "loss": ' + "[" * 100_000 + "]" * 100_000 + "}\n",
    "20260101-000002-lm-57e9": '{"step": "abc", "loss": 1.0}\n{"step": [1], "loss": "x"}\n{"step": 7.5, "loss": 1e999}\n{"step": true}\n',
    "20260101-000003-lm-b16b": None,  # a 64 MiB line without its end, written below
    "20260101-000004-lm-0dd5": '{"step": 5, "loss": 10' + "0" * 5000 + '}\n[1, 2]\n"text"\n',
}
GOOD = "20260101-000000-lm-9009"
LONG = "20260101-000003-lm-b16b"


def _steps(run_id: str) -> list[int]:
    """The steps a reader finds: the good records, except behind 64 MiB, beyond the read window."""
    return [] if run_id == LONG else [1, 2, 3, 4]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    root = make_workspace(tmp_path_factory.mktemp("poison") / "ws")
    fake_run(root, GOOD)
    for run_id, text in POISON.items():
        run_dir = fake_run(root, run_id)
        with open(run_dir / rd.METRICS_JSONL, "ab") as f:
            if text is None:
                chunk = b"x" * (1 << 20)
                f.write(b'{"step": 99, "loss": "')
                for _ in range(64):
                    f.write(chunk)
            else:
                f.write(text.encode())
    with live_client(build_server(root)) as live:
        yield live


def _ok(result):
    assert not result.is_error, error_text(result)[:500]
    return result.structured_content


def test_list_runs_lists_every_run(client):
    runs = _ok(client.call("list_runs", {}))["runs"]
    assert {r["run_id"] for r in runs} == {GOOD, *POISON}
    for run in runs:  # the good records before the poison are still read
        assert run["step"] == (_steps(run["run_id"]) or [None])[-1]
        assert run["loss"] is None or run["loss"] < 10


@pytest.mark.parametrize("run_id", [GOOD, *POISON])
def test_get_run_tail_and_the_picture_work_in_bounded_time(client, run_id):
    start = time.monotonic()
    info = _ok(client.call("get_run", {"run_id": run_id}))
    assert info["step"] == (_steps(run_id) or [None])[-1]
    tail = _ok(client.call("tail_metrics", {"run_id": run_id, "n": 200}))
    assert [r["step"] for r in tail["records"]] == _steps(run_id)
    after = _ok(client.call("tail_metrics", {"run_id": run_id, "after_step": 2}))["records"]
    assert [r["step"] for r in after] == _steps(run_id)[2:]
    assert client.read_resource(f"run://{run_id}/loss.png").contents[0].blob
    metrics = json.loads(client.read_resource(f"run://{run_id}/metrics").contents[0].text)
    assert [r["step"] for r in metrics["records"]] == _steps(run_id)
    assert time.monotonic() - start < 10


def test_a_long_line_costs_a_bounded_read(tmp_path):
    path = tmp_path / "metrics.jsonl"
    with open(path, "wb") as f:
        f.write(b'{"step": 1, "loss": 2.0}\n')
        f.write(b"y" * (64 << 20))
    start = time.monotonic()
    for _ in range(10):
        assert run_metrics.read_metrics_tail(path, 20)[0] == []  # only the window at the end is read
    assert run_metrics.read_all_metrics(path) == []
    assert time.monotonic() - start < 5
    assert run_metrics.read_metrics_tail(path, 20, max_bytes=1 << 30)[0] == [{"step": 1, "loss": 2.0}]
