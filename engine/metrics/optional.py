"""The optional metrics backends — Weights & Biases, MLflow, trackio — chosen by name in
``metrics.backends`` and imported only then.

:func:`check_backends` is part of the launch check (``engine.launch --check``), so a missing
package, or a destination the run cannot reach, refuses the launch before a run directory
exists rather than failing the run at its start. :func:`open_backends` opens them on rank 0.
Local modes are the defaults and write inside the run directory: a W&B offline run, an MLflow
SQLite store, a trackio store. Online destinations need ``runs.network: shared`` and their
credentials through ``runs.pass_env`` (runs get no secret-looking variable otherwise).
"""

from __future__ import annotations

import importlib.util
import os
import socket
from pathlib import Path
from typing import Any, Mapping
from urllib.parse import urlsplit

from engine.config import ConfigError, EngineConfig, MetricsConfig, config_keys
from engine.metrics.logger import MetricBackend

EXTRA = "trainwright[metrics]"
# The modules each backend imports, and the pip package of each.
PACKAGES: dict[str, dict[str, str]] = {
    "wandb": {"wandb": "wandb"},
    "mlflow": {"mlflow": "mlflow-skinny"},
    "trackio": {"trackio": "trackio"},
}
# MLflow's database stores (SQLite by default) need these besides mlflow-skinny.
MLFLOW_SQL = {"sqlalchemy": "sqlalchemy", "alembic": "alembic"}
LOCAL_MLFLOW_SCHEMES = ("sqlite", "file", "")


def required_packages(name: str, metrics: MetricsConfig) -> dict[str, str]:
    """``{module: pip package}`` that backend ``name`` needs with these settings."""
    needed = dict(PACKAGES[name])
    if name == "mlflow":
        uri = metrics.mlflow.tracking_uri
        if uri is None or urlsplit(uri).scheme not in ("file", "http", "https", "databricks", "databricks-uc", "uc"):
            needed.update(MLFLOW_SQL)
    return needed


def installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a broken installation, or one hidden from this process
        return False


def online_setting(name: str, metrics: MetricsConfig) -> str | None:
    """The key that sends backend ``name``'s metrics over the network, or None when it is local."""
    if name == "wandb" and metrics.wandb.mode == "online":
        return "metrics.wandb.mode=online"
    uri = metrics.mlflow.tracking_uri
    if name == "mlflow" and uri is not None and urlsplit(uri).scheme not in LOCAL_MLFLOW_SCHEMES:
        return "metrics.mlflow.tracking_uri"
    if name == "trackio" and metrics.trackio.space_id is not None:
        return "metrics.trackio.space_id"
    return None


OFFLINE = {
    "wandb": "metrics.wandb.mode=offline (`wandb sync` uploads the run later)",
    "mlflow": "metrics.mlflow.tracking_uri=null (a SQLite store in the run directory)",
    "trackio": "metrics.trackio.space_id=null (a local store in the run directory)",
}


def loopback_only() -> bool:
    """Whether this process sees no network interface but loopback (an isolated run's namespace)."""
    try:
        return all(name == "lo" for _, name in socket.if_nameindex())
    except OSError:
        return False


def wandb_key_available(environ: Mapping[str, str]) -> bool:
    home = environ.get("HOME")
    netrc = environ.get("NETRC") or (str(Path(home) / ".netrc") if home else "")
    return bool(environ.get("WANDB_API_KEY")) or bool(netrc and os.path.isfile(netrc))


def check_backends(metrics: MetricsConfig, environ: Mapping[str, str] | None = None) -> None:
    """Refuse, with the key or the package to change, backends this process could not open."""
    environ = os.environ if environ is None else environ
    for name in dict.fromkeys(metrics.backends):
        uri = metrics.mlflow.tracking_uri
        if name == "mlflow" and uri is not None and urlsplit(uri).scheme in LOCAL_MLFLOW_SCHEMES:
            # The run writes only its run directory (which does not exist yet at the check); a
            # store elsewhere is in the sandbox's own /tmp or home, discarded at its end, or
            # not writable at all: the metrics would be lost without a word.
            raise ConfigError(
                f"metrics.mlflow.tracking_uri {uri[:200]!r} names a local store outside the run directory, "
                f"which a run cannot keep: use {OFFLINE['mlflow']}, or an http(s) tracking server"
            )
        missing = [package for module, package in required_packages(name, metrics).items() if not installed(module)]
        if missing:
            raise ConfigError(
                f"metrics.backends has {name!r}, but {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} "
                f"not installed: pip install '{EXTRA}' (or pip install {' '.join(missing)}) where trainwright "
                f"runs, or remove {name!r} from metrics.backends"
            )
        setting = online_setting(name, metrics)
        if setting is None:
            continue
        if loopback_only():
            raise ConfigError(
                f"{setting} sends metrics over the network, but this run has only loopback "
                f"(runs.network: isolated): use {OFFLINE[name]}, or set runs.network: shared in "
                "the server's settings"
            )
        if name == "wandb" and not wandb_key_available(environ):
            raise ConfigError(
                "metrics.wandb.mode=online needs a W&B API key: list WANDB_API_KEY in runs.pass_env of "
                "the server's settings (runs get no secret-looking variable otherwise), or use "
                f"{OFFLINE['wandb']}"
            )


def open_backends(config: EngineConfig, run_dir: Path) -> list[MetricBackend]:
    """The backends of ``metrics.backends``, opened for the run in ``run_dir`` (rank 0 only)."""
    metrics = config.metrics
    run_id = Path(run_dir).name
    nested: dict[str, Any] = config.model_dump(mode="json")
    opened: list[MetricBackend] = []
    try:
        for name in dict.fromkeys(metrics.backends):
            try:
                if name == "wandb":
                    from engine.metrics.wandb import WandbBackend

                    opened.append(WandbBackend(metrics.wandb, run_dir, run_id, nested))
                elif name == "mlflow":
                    from engine.metrics.mlflow import MlflowBackend

                    opened.append(MlflowBackend(metrics.mlflow, run_dir, run_id, config_keys(config, json_mode=True)))
                elif name == "trackio":
                    from engine.metrics.trackio import TrackioBackend

                    opened.append(TrackioBackend(metrics.trackio, run_dir, run_id, nested))
            except Exception as e:
                raise RuntimeError(f"the {name} metrics backend could not start: {type(e).__name__}: {e}") from e
    except BaseException:
        for backend in opened:
            backend.close(failed=True)
        raise
    return opened
