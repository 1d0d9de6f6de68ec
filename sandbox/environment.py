"""The environment a training run gets: an allow-list, never the server's whole environment.

A server started by an agent host often holds API tokens and cloud credentials. A run gets
only the variables it needs to find Python, its devices and its caches; anything named like a
secret is dropped even when a broad pattern would admit it, unless the user lists it by its
exact name in ``TRAINWRIGHT_PASS_ENV`` (comma-separated).
"""

from __future__ import annotations

import fnmatch
import os
import re
from typing import Mapping

ALLOWED = (
    "PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LC_*", "TZ", "TERM", "TMPDIR",
    "VIRTUAL_ENV", "PYTHONPATH", "PYTHONHASHSEED",
    "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_*", "KMP_*",
    "CUDA_VISIBLE_DEVICES", "CUDA_HOME", "CUDA_PATH", "NVIDIA_*", "LD_LIBRARY_PATH",
    "NCCL_*", "TORCH_*", "TORCHINDUCTOR_*", "TRITON_*", "PYTORCH_*",
    "HF_HOME", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE",
    "TRANSFORMERS_CACHE", "XDG_CACHE_HOME",
)

_SECRET = re.compile(
    r"(TOKEN|SECRET|PASSW(OR)?D|PASSPHRASE|API_?KEY|ACCESS_?KEY|PRIVATE_?KEY|CREDENTIAL|AUTH|"
    r"SESSION_?KEY|COOKIE|^AWS_|^AZURE_|^GCP_|^GOOGLE_|^GH_|^GITHUB_|^OPENAI_|^ANTHROPIC_|^HF_TOKEN)",
    re.IGNORECASE,
)

PASS_ENV_VARIABLE = "TRAINWRIGHT_PASS_ENV"


def looks_secret(name: str) -> bool:
    return bool(_SECRET.search(name))


def run_environment(source: Mapping[str, str] | None = None, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for a run, built from ``source`` (default: this process's)."""
    source = dict(os.environ if source is None else source)
    passed = {n.strip() for n in source.get(PASS_ENV_VARIABLE, "").split(",") if n.strip()}
    env = {}
    for name, value in source.items():
        if name in passed:
            env[name] = value
        elif any(fnmatch.fnmatchcase(name, pattern) for pattern in ALLOWED) and not looks_secret(name):
            env[name] = value
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def redact(text: str, source: Mapping[str, str] | None = None) -> str:
    """Replace the values of secret-looking variables in ``text`` with ``***``."""
    source = os.environ if source is None else source
    for name, value in source.items():
        if looks_secret(name) and len(value) >= 6 and value in text:
            text = text.replace(value, "***")
    return text
