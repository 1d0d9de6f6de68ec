"""Metrics beyond metrics.jsonl: Weights & Biases (offline), MLflow (a SQLite store) and trackio (a
local store) in one real run on two processes launched through MCP, in the sandbox where the run
has only loopback. Rank 0 alone logs: each backend holds one run, read back with its own reader,
with exactly the steps and values of metrics.jsonl. get_run and `trainwright status` name where
the metrics went; a W&B key passed with pass_env appears in no file, result or log. A missing
package, or an online destination the run cannot reach or has no key for, refuses the launch at
its check, before any write."""

from __future__ import annotations

import contextlib
import importlib.abc
import io
import json
import struct
import sys
from pathlib import Path

import pytest

from engine import run_dir as rd
from engine import run_metrics
from engine.config import ConfigError
from engine.launch import main
from engine.metrics.optional import loopback_only
from mcp_server import cli
from mcp_server.server import build_server
from tests.sandbox.helpers import AUDIT, error_text, live_client, make_workspace, wait_final
from tests.support import TEMPLATE, TINY

KEY = "3f0c9a7e51b24d68a0e9c17b2d4f85a6c3e1b907"  # shaped like a W&B key; fake
BACKENDS = {"metrics.backends": ["wandb", "mlflow", "trackio"]}
OFFLINE_ENV = {"WANDB_MODE": "offline", "MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "true",
               "HF_HUB_OFFLINE": "1"}


def overrides(**extra):
    return {**dict(item.split("=", 1) for item in TINY), **extra}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One short run with the three backends: (workspace, run_dir, get_run's result, status text,
    the refusal of a launch with W&B online)."""
    root = make_workspace(tmp_path_factory.mktemp("metrics-out") / "ws",
                          config_yaml="runs:\n  threads_per_process: 1\n  pass_env: [WANDB_API_KEY]\n")
    trusted = root.parent / "trusted.yaml"
    trusted.write_text("runs:\n  pass_env: [WANDB_API_KEY]\n")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("WANDB_API_KEY", KEY)
        for name, value in OFFLINE_ENV.items():
            patch.setenv(name, value)
        with live_client(build_server(root, settings=trusted)) as client:
            online = client.call("launch_run", {"recipe": "recipes/lm", "overrides": overrides(
                **{"metrics.backends": ["wandb"], "metrics.wandb.mode": "online"})})
            assert online.is_error and not (root / "runs").exists(), "a refused launch writes nothing"
            result = client.call("launch_run", {"recipe": "recipes/lm", "nproc": 2, "overrides": overrides(
                **{"train.max_steps": 4, "train.eval_every": 2, **BACKENDS})})
            assert not result.is_error, error_text(result)
            run_id = result.structured_content["run_id"]
            run_dir = root / "runs" / run_id
            record = wait_final(run_dir)
            assert record.status == rd.COMPLETED, (record.error, (run_dir / rd.CONSOLE_LOG).read_text()[-3000:])
            info = client.call("get_run", {"run_id": run_id}).structured_content
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert cli.main(["status", run_id, "--workspace", str(root)]) == 0
    return root, run_dir, info, out.getvalue(), error_text(online)


def expected_values(run_dir: Path) -> dict[tuple[int, str], float]:
    """(step, key) → value of every number in metrics.jsonl."""
    values = {}
    for record in run_metrics.read_all_metrics(run_dir / rd.METRICS_JSONL):
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                values[(record["step"], key)] = float(value)
    return values


def destination(run_dir: Path, kind: str) -> rd.MetricsDestination:
    """Where run.json says the engine sent the metrics of ``kind``."""
    (found,) = [d for d in rd.read_run(run_dir).metrics_destinations if d.kind == kind]
    return found


@pytest.mark.slow  # one real run on 2 processes (about 40 s on 2 cores), shared by the module
@pytest.mark.multiprocess
def test_the_run_logged_train_and_eval_steps_to_metrics_jsonl(run):
    _, run_dir, _, _, _ = run
    keys = expected_values(run_dir)
    assert {step for step, _ in keys} == {1, 2, 3, 4}
    assert {(2, "eval_loss"), (4, "eval_loss"), (4, "loss"), (4, "lr"), (4, "tokens_seen")} <= set(keys)


def wandb_records(path: Path):
    """The records of a W&B offline run file: a LevelDB-style log (a 7-byte header ``:W&B``,
    magic 0xBEE1, version; 32 KiB blocks of chunks with a crc32c, length, type) of protobufs."""
    data = path.read_bytes()
    assert data[:4] == b":W&B" and struct.unpack("<HB", data[4:7]) == (0xBEE1, 0), data[:7]
    block, position, pieces = 32768, 7, b""
    while position + 7 <= len(data):
        left = block - position % block
        if left < 7:  # a block's tail too short for a header is padding
            position += left
            continue
        _, length, kind = struct.unpack("<IHB", data[position:position + 7])
        chunk = data[position + 7:position + 7 + length]
        position += 7 + length
        if kind == 1:  # full
            yield chunk
        elif kind in (2, 3):  # first, middle
            pieces = (b"" if kind == 2 else pieces) + chunk
        elif kind == 4:  # last
            yield pieces + chunk


@pytest.mark.slow  # one real run on 2 processes (about 40 s on 2 cores), shared by the module
@pytest.mark.multiprocess
def test_wandb_offline_run_holds_the_same_steps_and_values(run):
    from wandb.proto import wandb_internal_pb2

    _, run_dir, _, _, _ = run
    where = destination(run_dir, "wandb")
    folder = Path(where.location)
    assert list((run_dir / "wandb").glob("offline-run-*")) == [folder], "rank 0 only"
    assert where.view == f"wandb sync {folder}"
    (log,) = folder.glob("run-*.wandb")
    logged, header = {}, None
    for raw in wandb_records(log):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "run":
            header = record.run
        elif record.WhichOneof("record_type") == "history":
            step = record.history.step.num
            for item in record.history.item:
                key = item.key or "/".join(item.nested_key)
                if not key.startswith("_"):  # wandb's own: _timestamp, _runtime, _step
                    logged[(step, key)] = float(json.loads(item.value_json))
    assert header.project == "trainwright" and header.display_name == run_dir.name
    assert where.run == f"trainwright/{header.run_id}"
    assert logged == expected_values(run_dir)


@pytest.mark.slow  # one real run on 2 processes (about 40 s on 2 cores), shared by the module
@pytest.mark.multiprocess
def test_mlflow_store_holds_the_same_steps_and_values(run, monkeypatch):
    for name, value in OFFLINE_ENV.items():
        monkeypatch.setenv(name, value)
    from mlflow.tracking import MlflowClient

    _, run_dir, _, _, _ = run
    where = destination(run_dir, "mlflow")
    assert where.location == f"sqlite:///{run_dir / 'mlflow' / 'mlflow.db'}"
    assert where.view == f"mlflow ui --backend-store-uri {where.location}"
    experiment, run_id = where.run.split("/")
    client = MlflowClient(tracking_uri=where.location)
    tracked = client.get_run(run_id)
    assert experiment == "trainwright" and tracked.info.run_name == run_dir.name
    assert [r.info.run_id for r in client.search_runs([tracked.info.experiment_id])] == [run_id], "rank 0 only"
    assert tracked.info.status == "FINISHED"
    assert tracked.data.params["train.max_steps"] == "4"
    assert tracked.data.params["metrics.backends"] == '["wandb", "mlflow", "trackio"]'
    logged = {(m.step, key): m.value for key in tracked.data.metrics for m in client.get_metric_history(run_id, key)}
    assert logged == expected_values(run_dir)


@pytest.mark.slow  # one real run on 2 processes (about 40 s on 2 cores), shared by the module
@pytest.mark.multiprocess
def test_trackio_store_holds_the_same_steps_and_values(run, monkeypatch):
    for name, value in OFFLINE_ENV.items():
        monkeypatch.setenv(name, value)
    from trackio import sqlite_storage

    _, run_dir, _, _, _ = run
    where = destination(run_dir, "trackio")
    assert Path(where.location) == run_dir / "trackio" and where.run == f"trainwright/{run_dir.name}"
    # trackio reads its folder from TRACKIO_DIR once, at import: point its reader at the run's store.
    monkeypatch.setattr(sqlite_storage, "TRACKIO_DIR", run_dir / "trackio")
    assert sqlite_storage.SQLiteStorage.get_runs("trainwright") == [run_dir.name], "rank 0 only"
    logged = {}
    for row in sqlite_storage.SQLiteStorage.get_logs("trainwright", run_dir.name):
        logged.update({(row["step"], k): float(v) for k, v in row.items() if k not in ("step", "timestamp")})
    assert logged == expected_values(run_dir)


@pytest.mark.slow  # one real run on 2 processes (about 40 s on 2 cores), shared by the module
@pytest.mark.multiprocess
def test_get_run_and_status_name_where_the_metrics_went(run):
    root, run_dir, info, status, _ = run
    label = run_dir.relative_to(root).as_posix()
    wandb_dir = Path(destination(run_dir, "wandb").location).name
    mlflow_run = destination(run_dir, "mlflow").run
    uri = f"sqlite:///{run_dir}/mlflow/mlflow.db"
    expected = [
        f"jsonl: {label}/metrics.jsonl",
        f"tensorboard: {label}/tensorboard",
        f"wandb: {label}/wandb/{wandb_dir} (trainwright/{wandb_dir.rsplit('-', 1)[1]}); "
        f"wandb sync {label}/wandb/{wandb_dir}",
        f"mlflow: {uri} ({mlflow_run}); mlflow ui --backend-store-uri {uri.replace(f'{root}/', '')}",
        f"trackio: {label}/trackio (trainwright/{run_dir.name}); "
        f"TRACKIO_DIR={label}/trackio trackio show --project trainwright",
    ]
    assert info["metrics_destinations"] == expected
    assert [line.strip() for line in status.splitlines() if line.startswith("  metrics ")] == [
        f"metrics    {line}" for line in expected]


@pytest.mark.slow  # one real run on 2 processes (about 40 s on 2 cores), shared by the module
@pytest.mark.multiprocess
def test_the_run_had_only_loopback(run):
    _, run_dir, info, _, _ = run
    if not info["network_isolated"]:
        pytest.skip(f"runs cannot be network-isolated here: {info['network_note']}")
    assert rd.read_run(run_dir).network_isolated is True


@pytest.mark.slow  # one real run on 2 processes (about 40 s on 2 cores), shared by the module
@pytest.mark.multiprocess
def test_a_key_passed_with_pass_env_appears_nowhere(run):
    root, run_dir, info, status, _ = run
    texts = [json.dumps(info), status, (root / AUDIT).read_text()]
    for path in run_dir.rglob("*"):
        if path.is_file() and not path.is_symlink():
            assert KEY.encode() not in path.read_bytes(), path
    assert not any(KEY in text for text in texts)


# ---------------------------------------------------------------------------------------------
# Refusals at the launch check
# ---------------------------------------------------------------------------------------------

class Hidden(importlib.abc.MetaPathFinder):
    """Makes the import system answer that ``modules`` are not installed."""

    def __init__(self, modules):
        self.modules = set(modules)

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.modules:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


def check(capsys, monkeypatch, tmp_path, hidden=(), key=None, *settings):
    """The launch check's verdict on the template with ``settings``, ``hidden`` not installed."""
    monkeypatch.setattr(sys, "meta_path", [Hidden(hidden), *sys.meta_path])
    for module in hidden:
        monkeypatch.delitem(sys.modules, module, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    monkeypatch.delenv("NETRC", raising=False)
    if key is None:
        monkeypatch.delenv("WANDB_API_KEY", raising=False)
    else:
        monkeypatch.setenv("WANDB_API_KEY", key)
    main([str(TEMPLATE), "--check", *[f"--set={s}" for s in settings]])
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


EXTRA_HINT = "pip install 'trainwright[metrics]'"


def test_a_missing_package_refuses_the_check_naming_the_pip_extra(capsys, monkeypatch, tmp_path):
    def error(hidden, *settings):
        with monkeypatch.context() as patch:
            return check(capsys, patch, tmp_path, hidden, None, *settings).get("error")

    assert check(capsys, monkeypatch, tmp_path, (), None, "metrics.backends=[wandb,mlflow,trackio]")["ok"]
    assert error(["wandb"], "metrics.backends=[wandb]") == (
        f"metrics.backends has 'wandb', but wandb is not installed: {EXTRA_HINT} (or pip install wandb) "
        "where trainwright runs, or remove 'wandb' from metrics.backends"
    )
    assert error(["trackio"], "metrics.backends=[mlflow,trackio]").startswith(
        f"metrics.backends has 'trackio', but trackio is not installed: {EXTRA_HINT}")
    assert error(["mlflow", "sqlalchemy"], "metrics.backends=[mlflow]").startswith(
        f"metrics.backends has 'mlflow', but mlflow-skinny, sqlalchemy are not installed: {EXTRA_HINT} "
        "(or pip install mlflow-skinny sqlalchemy)")
    # A tracking server needs no database package (the check does not reach the server).
    assert error(["sqlalchemy"], "metrics.backends=[mlflow]", "metrics.mlflow.tracking_uri=http://127.0.0.1:9") is None
    assert list(tmp_path.iterdir()) == [], "a check writes nothing"


def test_wandb_online_without_a_key_refuses_the_check_naming_pass_env(capsys, monkeypatch, tmp_path):
    if loopback_only():
        pytest.skip("this machine has no network interface but loopback")
    online = ("metrics.backends=[wandb]", "metrics.wandb.mode=online")
    assert check(capsys, monkeypatch, tmp_path, (), None, *online)["error"] == (
        "metrics.wandb.mode=online needs a W&B API key: list WANDB_API_KEY in runs.pass_env of the server's "
        "settings (runs get no secret-looking variable otherwise), or use metrics.wandb.mode=offline "
        "(`wandb sync` uploads the run later)"
    )
    assert check(capsys, monkeypatch, tmp_path, (), KEY, *online)["ok"]


@pytest.mark.slow  # one real run on 2 processes (about 40 s on 2 cores), shared by the module
@pytest.mark.multiprocess
def test_an_online_destination_of_an_isolated_run_is_refused_before_any_write(run):
    *_, refusal = run
    if "only loopback" not in refusal:
        pytest.skip(f"runs are not network-isolated here: {refusal}")
    assert refusal.endswith(
        "metrics.wandb.mode=online sends metrics over the network, but this run has only loopback "
        "(runs.network: isolated): use metrics.wandb.mode=offline (`wandb sync` uploads the run later), "
        "or set runs.network: shared in the server's settings"
    )


def test_a_backend_s_keys_are_described_once_it_is_chosen():
    from engine.config import EngineConfig, build_config, describe_fields

    def metrics_keys(*overrides):
        keys = [f["key"] for f in describe_fields(build_config(EngineConfig, None, overrides))]
        return [k for k in keys if k.startswith("metrics.")]

    assert metrics_keys() == ["metrics.tensorboard", "metrics.peak_tflops", "metrics.backends"]
    assert metrics_keys("metrics.backends=[mlflow]") == [
        "metrics.tensorboard", "metrics.peak_tflops", "metrics.backends",
        "metrics.mlflow.tracking_uri", "metrics.mlflow.experiment", "metrics.mlflow.run_name",
    ]
    # Left out of the description, still valid keys: they are checked whatever the backends.
    with pytest.raises(ConfigError, match="unknown config key 'metrics.wandb.projekt'.*did you mean 'metrics.wandb.project'"):
        build_config(EngineConfig, None, ["metrics.wandb.projekt=x"])
    assert build_config(EngineConfig, None, ["metrics.wandb.project=x"]).metrics.wandb.project == "x"


def test_backends_get_every_number_of_a_record_and_nothing_they_cannot_take():
    from engine.metrics.logger import numbers

    sent = numbers({"step": 3, "loss": float("nan"), "grad_norm": float("inf"), "tokens_seen": 7, "note": "text",
                    "flag": True, "huge": 10**400, "nested": {"a": 1}, "missing": None})
    assert set(sent) == {"loss", "grad_norm", "tokens_seen"} and sent["tokens_seen"] == 7
