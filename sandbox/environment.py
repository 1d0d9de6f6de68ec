"""The environment a training run gets: an allow-list, never the server's whole environment.

A server started by an agent host often holds API tokens and cloud credentials. A run gets
only the variables it needs to find Python, its devices and its caches; anything named like a
secret is dropped even when a broad pattern would admit it, unless the user lists it by its
exact name — in ``runs.pass_env`` of ``.trainwright/config.yaml`` or in the server's
``TRAINWRIGHT_PASS_ENV`` (comma-separated). So is a value that :mod:`sandbox.redact` takes for
a secret whatever the variable's name (``HF_HOME=https://user:pw@host/``, a token, a long random
string such as a GPU UUID in ``CUDA_VISIBLE_DEVICES``).

Every run also gets ``OMP_NUM_THREADS`` set explicitly (from the server's environment, the
config, or CPU cores / processes), and the value is recorded in ``run.json``, so a resumed run
computes with the same thread count: on CPU that is what makes a resume bit-identical. How its
OpenMP threads wait is the engine's to decide (:mod:`engine.openmp`); a run of the user's own
script gets ``OMP_WAIT_POLICY=PASSIVE`` from its launcher (:func:`engine.openmp.sleep_while_waiting`).

``PYTHONSAFEPATH`` keeps the working directory (the workspace) off ``sys.path``: a run imports
trainwright from its installation and the recipe from its snapshot, nothing else from the
workspace.
"""

from __future__ import annotations

import fnmatch
import os
import re
from typing import Iterable, Mapping

ALLOWED = (
    "PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LC_*", "TZ", "TERM", "TMPDIR",
    "VIRTUAL_ENV", "PYTHONPATH", "PYTHONHASHSEED",
    "OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "MKL_NUM_THREADS", "OPENBLAS_*", "KMP_*",
    "CUDA_VISIBLE_DEVICES", "CUDA_HOME", "CUDA_PATH", "NVIDIA_*", "LD_LIBRARY_PATH",
    "NCCL_*", "GLOO_*", "TORCH_*", "TORCHINDUCTOR_*", "TRITON_*", "PYTORCH_*",
    "HF_HOME", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE",
    "TRANSFORMERS_CACHE", "XDG_CACHE_HOME",
)

_SECRET = re.compile(
    r"(TOKEN|SECRET|PASSW(OR)?D|_PWD$|^SK_|(^|_)SK$|STRIPE|PASSPHRASE|API_?KEY|ACCESS_?KEY|PRIVATE_?KEY|CREDENTIAL|AUTH|"
    r"SESSION_?KEY|COOKIE|SIGNING|WEBHOOK|DSN$|(^|_)KEY$|(^|_)PASS$|_PAT$|CONNECTION_STRING|"
    r"^AWS_|^AZURE_|^GCP_|^GCLOUD_|^GOOGLE_|^GH_|^GITHUB_|^GITLAB_|^OPENAI_|^ANTHROPIC_|^HF_TOKEN|"
    r"^KUBECONFIG$|^DATABASE_URL$)",
    re.IGNORECASE,
)

PASS_ENV_VARIABLE = "TRAINWRIGHT_PASS_ENV"
THREADS_VARIABLE = "OMP_NUM_THREADS"


def looks_secret(name: str) -> bool:
    return bool(_SECRET.search(name))


def passed_names(source: Mapping[str, str], pass_env: Iterable[str] = ()) -> set[str]:
    """Names the user lets through: ``TRAINWRIGHT_PASS_ENV`` plus ``runs.pass_env``."""
    names = {n.strip() for n in source.get(PASS_ENV_VARIABLE, "").split(",") if n.strip()}
    return names | {n for n in pass_env if n}


def run_environment(
    source: Mapping[str, str] | None = None,
    extra: Mapping[str, str] | None = None,
    pass_env: Iterable[str] = (),
) -> dict[str, str]:
    """The environment for a run, built from ``source`` (default: this process's)."""
    from sandbox.redact import secret_values

    source = dict(os.environ if source is None else source)
    passed = passed_names(source, pass_env)
    env = {}
    for name, value in source.items():
        if name in passed:
            env[name] = value
        elif (any(fnmatch.fnmatchcase(name, pattern) for pattern in ALLOWED) and not looks_secret(name)
              and not secret_values({name: value})):
            # A value the redactor would hide (a URL with a password, a token, a long random
            # string) is a secret whatever its variable is called: only runs.pass_env lets it in.
            env[name] = value
    env["PYTHONUNBUFFERED"] = "1"
    # Runs and checks start in the workspace; Python would put that folder first on sys.path
    # for ``python -m``, so a ``runner/`` or ``engine/`` package written there would run in
    # place of trainwright's, and a recipe could import workspace code that no snapshot holds.
    # The recipe's own folder is put on sys.path by the engine. (Python >= 3.11; torchrun's
    # workers inherit it.)
    env["PYTHONSAFEPATH"] = "1"
    env.update(extra or {})
    return env


def threads_per_process(nproc: int, configured: int | None = None, source: Mapping[str, str] | None = None) -> int:
    """The thread count a run's processes compute with (see the module docstring)."""
    if configured:
        return int(configured)
    source = os.environ if source is None else source
    value = source.get(THREADS_VARIABLE, "")
    if value.isdigit() and int(value) > 0:
        return int(value)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, nproc))
