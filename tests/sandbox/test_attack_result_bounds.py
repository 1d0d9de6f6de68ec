"""The fields of a run that recipe code or a recipe's files choose (data paths from its
config.yaml, the names of its changed files, what the run writes into its own run.json) keep
get_run and launch_run under an agent's budget."""

from __future__ import annotations

import json
import os

from engine import run_dir as rd
from mcp_server.limits import AGENT_BUDGET_CHARS, MAX_ERROR_CHARS
from mcp_server.server import build_server
from tests.sandbox.helpers import fake_run, live_client, make_workspace

LONG_PATH = "data/" + "./" * 1900 + "a.txt"  # a valid path of 3,810 characters
DEEP_FILE = "recipes/lm/" + "d" * 200 + "/" + "/".join(["e" * 200] * 15) + "/x.py"


def test_get_run_stays_in_budget_whatever_run_json_holds(tmp_path):
    root = make_workspace(tmp_path / "ws")
    data = {"source": "files", "paths": [LONG_PATH] * 20, "files": 1, "documents": 1, "tokens": 2,
            "train_documents": 1, "eval_documents": 0, "train_tokens": 2, "eval_tokens": 0,
            "tokenizer": "t" * 5000}
    run_id = "20260101-000000-lm-long"
    fake_run(root, run_id, git_commit="a" * 40, recipe_dirty=True, dirty_files=[DEEP_FILE] * 20, data=data,
             recipe="r" * 20_000, snapshot="s" * 20_000, network_note="n" * 20_000)
    with live_client(build_server(root)) as client:
        result = client.call("get_run", {"run_id": run_id})
        assert not result.is_error, result.content
        size = len(json.dumps(result.structured_content))
        assert size <= AGENT_BUDGET_CHARS, f"get_run returned {size} characters"
        out = result.structured_content
        assert out["data"]["documents"] == 1 and out["recipe_dirty"] is True
        assert "…" in out["code"] or len(out["code"]) < 1000
        assert rd.read_run(root / "runs" / run_id).data.paths == [LONG_PATH] * 20  # run.json keeps all


def test_a_check_that_prints_without_end_costs_bounded_memory_and_no_disk(tmp_path):
    """The launch check and the model process run recipe code whose output is kept: 256 MiB
    printed (and a child that keeps the pipe open) leaves the last 4 MiB, and never lies on disk."""
    import shutil
    import sys
    import tempfile
    import threading
    import time

    from workspace.settings import RunLimits
    from runner.processes import run_contained
    from sandbox.contained import MAX_OUTPUT_BYTES as MAX_CHECK_OUTPUT_BYTES

    root = make_workspace(tmp_path / "ws")
    script = (
        "import subprocess, sys, time\n"
        "subprocess.Popen(['sleep', '4242.37'])\n"  # holds stdout open; ended with the check
        "line = b'x' * 1023 + b'\\n'\n"
        "for _ in range(256 * 1024): sys.stdout.buffer.write(line)\n"
        "sys.stdout.buffer.write(b'THE END\\n'); sys.stdout.flush()\n"
        "sys.stderr.write('err tail\\n'); time.sleep(1)\n"
    )
    free = [shutil.disk_usage(tempfile.gettempdir()).free]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.05):
            free.append(shutil.disk_usage(tempfile.gettempdir()).free)

    sampler = threading.Thread(target=sample)
    sampler.start()
    started = time.monotonic()
    try:
        out, err = run_contained([sys.executable, "-c", script], root, [], [], dict(os.environ), RunLimits(),
                                 timeout_s=120, mark="bounded-output-check")
    finally:
        done.set()
        sampler.join()
    assert time.monotonic() - started < 60
    assert out.endswith("THE END\n") and len(out) <= MAX_CHECK_OUTPUT_BYTES
    assert err == "err tail\n"
    assert min(free) > free[0] - 128 * 2**20, "the output was written to disk"


def test_output_nested_too_deep_for_json_is_no_verdict_and_no_result(tmp_path, monkeypatch):
    """A line of 100,000 '[' makes json.loads raise RecursionError, not ValueError: it reached
    the agent as 'internal: a trainwright bug'. It is read as what it is: no verdict, no result."""
    import pytest

    from engine.seams import read_model_result
    from runner import model_process
    from runner import lifecycle as run_lifecycle

    deep = "[" * 100_000
    monkeypatch.setattr(run_lifecycle, "run_contained", lambda *args, **kwargs: (deep + "\n", "the last words\n"))
    with pytest.raises(run_lifecycle.LaunchRefused, match="could not check the recipe: the last words"):
        run_lifecycle.check_launch(tmp_path, tmp_path, 1, [])
    result = tmp_path / "result.json"
    result.write_text(deep)
    assert read_model_result("sample", model_process._read_result(result)) is None


def test_a_malformed_verdict_from_the_check_is_a_refusal(tmp_path, monkeypatch):
    """The check's verdict is printed by the process that imported the recipe, so recipe code can
    print one of its own. Missing or mistyped fields reached the agent as 'internal: a trainwright
    bug' (KeyError: 'error', KeyError: 'config', a ValidationError writing run.json)."""
    import pytest

    from runner import lifecycle as run_lifecycle

    good = {"ok": True, "config": {"train": {}}, "config_changes": {}, "data": None, "fields": []}
    forged = [
        {"ok": False},
        {"ok": False, "error": ["not", "text"]},
        {"ok": True},
        {**good, "config": ["a list"]},
        {**good, "config_changes": "text"},
        {**good, "data": {"documents": "many"}},
        {**good, "fields": [1, 2]},
    ]
    for verdict in forged:
        monkeypatch.setattr(run_lifecycle, "run_contained", lambda *args, **kwargs: (json.dumps(verdict) + "\n", ""))
        with pytest.raises(run_lifecycle.LaunchRefused) as refused:
            run_lifecycle.check_launch(tmp_path, tmp_path, 1, [])
        assert len(str(refused.value)) <= MAX_ERROR_CHARS, verdict
    monkeypatch.setattr(run_lifecycle, "run_contained", lambda *args, **kwargs: (json.dumps(good) + "\n", ""))
    assert run_lifecycle.check_launch(tmp_path, tmp_path, 1, []).model_dump() == {**good, "estimate": None}
