"""`trainwright scaffold` with a model by Hub id: a progress bar on stderr while it downloads
from a Hub endpoint served on 127.0.0.1, and a clear exit 2 for a gated repo."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.fake_hub import FakeHub, tiny_llama_folder


def test_scaffold_downloads_a_hub_model_with_a_progress_bar_and_refuses_a_gated_one(tmp_path):
    model = tiny_llama_folder(tmp_path / "model")
    hub = FakeHub()
    hub.add("org/tiny", model)
    hub.add("org/gated", model, gated=True)
    url = hub.start()
    env = {k: v for k, v in os.environ.items() if k not in ("HF_TOKEN", "HF_HUB_OFFLINE")}
    env.update(HF_ENDPOINT=url, HF_HOME=str(tmp_path / "hf"))
    workspace = tmp_path / "ws"
    workspace.mkdir()

    def scaffold(name, repo):
        return subprocess.run(
            [sys.executable, "-m", "mcp_server.cli", "scaffold", "causal_lm", name, "--config",
             f"model.pretrained_path={repo}", "--workspace", str(workspace)],
            capture_output=True, text=True, timeout=600, env=env,
        )

    try:
        done = scaffold("lm", "org/tiny")
        assert done.returncode == 0, done.stdout + done.stderr
        assert "created recipes/lm" in done.stdout
        assert "downloading org/tiny" in done.stderr and "100%" in done.stderr
        assert (tmp_path / "hf" / "hub" / "models--org--tiny" / "refs" / "main").read_text() == hub.repos["org/tiny"].commit
        refused = scaffold("gated", "org/gated")
        assert refused.returncode == 2
        assert "org/gated is a gated repo" in refused.stderr
        assert not (workspace / "recipes" / "gated").exists()
    finally:
        hub.stop()
