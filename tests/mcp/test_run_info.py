"""get_run's answer (RunInfo) is built from the run's record: the facts they share
(engine.run_dir.RunFacts) are declared once, and get_run shows each as the server's record
holds it. No process is started here."""

from __future__ import annotations

from engine import run_dir as rd
from runner import server_record as sr
from mcp_server.models import RunInfo
from mcp_server.operations import runs
from workspace.workspace import Workspace
from tests.sandbox.helpers import fake_run, make_workspace

# Shown otherwise than recorded: the effective status; error, overrides, config_changes and
# warnings bounded; resumed_from's path relative to the workspace.
SHOWN_OTHERWISE = {"status", "error", "overrides", "config_changes", "warnings", "resumed_from"}


def test_run_info_declares_none_of_the_records_fields_again():
    assert issubclass(RunInfo, rd.RunFacts) and issubclass(rd.RunRecord, rd.RunFacts)
    assert not set(RunInfo.__annotations__) & set(rd.RunFacts.model_fields)
    for name, field in rd.RunFacts.model_fields.items():  # the record's types, not looser ones
        assert RunInfo.model_fields[name].annotation == field.annotation, name
    # The names `trainwright status` and the run view read are still there.
    assert {"run_id", "status", "recipe", "code", "world_size", "nproc", "nodes", "data", "config_changes",
            "isolation", "isolation_note", "step", "max_steps", "latest", "speed", "eta_s", "checkpoints",
            "metrics_destinations", "network_note", "error", "warnings", "console_tail"} <= set(RunInfo.model_fields)


def test_get_run_shows_every_fact_as_the_servers_record_holds_it(tmp_path):
    root = make_workspace(tmp_path / "ws")
    run_id = "20260101-000000-lm-fact"
    fake_run(root, run_id, kind="recipe", snapshot="runs/x/recipe", git_commit="a" * 40, recipe_dirty=True, nproc=3,
             world_size=3, started_at="2026-01-01T00:00:01Z", ended_at="2026-01-01T00:00:09Z", exit_code=0,
             limits={"max_memory_bytes": 1 << 30}, network_isolated=True, network_note="no network",
             isolation="partial", isolation_note="no user namespace", overrides={"train.max_steps": 4},
             config_changes={"train.max_steps": 4}, warnings=["a warning"])
    record = sr.known_run(root, root / rd.RUNS_DIRNAME / run_id)
    shown = runs.get_run(Workspace.open(root), run_id)
    for name in set(rd.RunFacts.model_fields) - SHOWN_OTHERWISE:
        assert getattr(shown, name) == getattr(record, name), name
    assert (shown.status, shown.overrides, shown.config_changes, shown.warnings) == (
        "completed", {"train.max_steps": 4}, {"train.max_steps": 4}, ["a warning"])
    assert (shown.run_id, shown.nproc, shown.limits, shown.isolation) == (run_id, 3, {"max_memory_bytes": 1 << 30}, "partial")


def test_run_info_of_takes_every_shared_fact_from_the_record():
    # RunInfo.of takes every RunFacts field from the record: nothing lists them one by one.
    record = rd.RunRecord(id="r", recipe="recipes/lm", nproc=2, isolation="none")
    info = RunInfo.of(record, run_id="r", run_dir="runs/r", code="recipe")
    assert {name: getattr(info, name) for name in rd.RunFacts.model_fields} == {
        name: getattr(record, name) for name in rd.RunFacts.model_fields}


def test_get_run_and_wait_run_show_the_data_being_tokenized_as_the_run_writes_it(tmp_path):
    import os

    import anyio

    from mcp_server.operations.waiting import wait_run

    root = make_workspace(tmp_path / "ws")
    run_id = "20260101-000000-lm-prep"
    pending = rd.DataSummary(source="files", paths=["data"], files=2, documents=0, tokens=0, train_documents=0,
                             eval_documents=0, train_tokens=0, eval_tokens=0, bytes=400_000_000,
                             preparing=rd.DataPreparation(bytes_total=400_000_000))
    run_dir = fake_run(root, run_id, status=rd.RUNNING, steps=0, checkpoints=(), pid=os.getpid(), data=pending)
    # The run's first phase writes its progress into run.json (engine.launch.prepare_data).
    rd.update_run(run_dir, data=pending.model_copy(update={"preparing": rd.DataPreparation(
        documents=1200, bytes_done=100_000_000, bytes_total=400_000_000, eta_s=30.0)}))
    shown = runs.get_run(Workspace.open(root), run_id)
    assert shown.data["preparing"] == {"documents": 1200, "bytes_done": 100_000_000, "bytes_total": 400_000_000,
                                       "eta_s": 30.0}
    heard = []

    async def on_progress(now):
        heard.append(now.progress_message())

    result = anyio.run(lambda: wait_run(Workspace.open(root), run_id, timeout_s=0.05, on_progress=on_progress))
    assert result.reason == "timeout" and result.step is None
    assert heard == ["tokenizing the data as the run's first phase: 1,200 documents, 100.0 of 400.0 MB, "
                     "about 30 s left"]
