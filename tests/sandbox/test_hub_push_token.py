"""The server's Hub token for a push (runner/hub_push.py): where it comes from, that the
variables holding it never reach a sandboxed process whatever runs.pass_env says, that texts
lose it by value, and how push targets are read."""

from __future__ import annotations

import pytest

from engine.errors import BadInput
from runner import hub_push

TOKEN = "hf_pushTokenForTheseTests0123456789abcd"


@pytest.mark.parametrize("given, repo_id, branch", [
    ("hub:me/model", "me/model", None),
    ("hub:me/model@dev", "me/model", "dev"),
    ("hub:my-org/tiny.ft_2@release/v1", "my-org/tiny.ft_2", "release/v1"),
])
def test_a_push_target_names_a_repo_and_maybe_a_branch(given, repo_id, branch):
    assert hub_push.push_target(given) == hub_push.PushTarget(given, repo_id, branch)


def test_a_workspace_folder_is_not_a_push_target_and_a_malformed_one_is_refused():
    assert hub_push.push_target("exports/model") is None
    assert hub_push.push_target("hub:me/model") == hub_push.PushTarget("hub:me/model", "me/model", None)
    for bad in ("hub:", "hub:model", "hub:me/model/extra", "hub:../x", "hub:me/mo del"):
        with pytest.raises(BadInput, match="is not a Hub repo: give hub:org/name or hub:org/name@branch"):
            hub_push.push_target(bad)
    with pytest.raises(BadInput, match="names a commit; a push goes to a branch: hub:me/model@BRANCH"):
        hub_push.push_target("hub:me/model@" + "a" * 40)


def test_the_token_comes_from_the_servers_environment_and_offline_refuses():
    assert hub_push.server_token({"HF_TOKEN": f" {TOKEN}\n"}) == TOKEN
    assert hub_push.server_token({"HUGGING_FACE_HUB_TOKEN": TOKEN}) == TOKEN
    with pytest.raises(BadInput, match="^the server has no Hugging Face token, so it cannot push: start"):
        hub_push.server_token({"HF_TOKEN": " "})
    with pytest.raises(BadInput, match="^the server runs with HF_HUB_OFFLINE set, so it cannot push"):
        hub_push.server_token({"HF_TOKEN": TOKEN, "HF_HUB_OFFLINE": "1"})


def test_every_variable_holding_the_token_is_kept_from_the_sandbox_and_texts_lose_it():
    environ = {"HF_TOKEN": TOKEN, "MY_HUB_KEY": TOKEN, "AUTH_HEADER": f"Bearer {TOKEN}", "HOME": "/root"}
    assert hub_push.token_variables(TOKEN, environ) == {"HF_TOKEN", "MY_HUB_KEY", "AUTH_HEADER"}
    text = f"401 for url with Authorization: Bearer {TOKEN}; token={TOKEN[:-1]}x"
    scrubbed = hub_push.scrub(text, TOKEN)
    assert TOKEN not in scrubbed and "Bearer ***" in scrubbed


def test_the_push_gives_its_sandboxed_processes_no_token_variable_whatever_pass_env_says(tmp_path, monkeypatch):
    """push_checkpoint hands run_model_io and evaluate the workspace's limits less the token's
    variables; both are caught here, before any process starts, and the push stops there."""
    from mcp_server.operations import push
    from workspace.settings import RunLimits
    from workspace.workspace import Workspace

    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setenv("OTHER_COPY", TOKEN)
    monkeypatch.setattr(hub_push, "check_access", lambda target, token: "me")
    monkeypatch.setattr(push, "checkpoint_of", lambda ws, run_id, step: (tmp_path, 4))
    monkeypatch.setattr(push.sr, "known_run", lambda root, run_dir: None)
    monkeypatch.setattr(Workspace, "run_limits",
                        lambda self: RunLimits(pass_env=("HF_TOKEN", "OTHER_COPY", "WANDB_API_KEY")))
    seen = []

    class Stop(Exception):
        pass

    def model_io(root, run_dir, action, step, arguments, limits, timeout_s, writable=None):
        seen.append(limits.pass_env)
        raise Stop

    monkeypatch.setattr(push, "run_model_io", model_io)
    with pytest.raises(Stop):
        push.push_checkpoint(Workspace(tmp_path), "run", hub_push.PushTarget("hub:me/m", "me/m", None), None,
                             "merged", "2GB", None, False)
    assert seen == [("WANDB_API_KEY",)]


def test_a_link_the_recipes_export_plants_is_never_followed_into_the_upload(tmp_path, monkeypatch):
    """The export is the recipe's code, and the server uploads what it wrote: a link in it to the
    server's own token file (``hf auth login``'s) would push the token. The push is refused,
    nothing is uploaded, and the staging folder is gone."""
    from mcp_server.operations import push
    from runner.model_process import ModelProcessFailed
    from workspace.settings import RunLimits
    from workspace.workspace import Workspace

    secret = tmp_path / "token"
    secret.write_text(TOKEN)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setattr(hub_push, "check_access", lambda target, token: "me")
    monkeypatch.setattr(push, "checkpoint_of", lambda ws, run_id, step: (tmp_path, 4))
    monkeypatch.setattr(push.sr, "known_run", lambda root, run_dir: None)
    monkeypatch.setattr(Workspace, "run_limits", lambda self: RunLimits())
    staged, uploaded = [], []

    def model_io(root, run_dir, action, step, arguments, limits, timeout_s, writable=None):
        folder = writable[0]  # what a hostile recipe's export writes there
        (folder / "config.json").write_text("{}")
        (folder / "tokenizer.json").symlink_to(secret)
        staged.append(folder.parent)

    monkeypatch.setattr(push, "run_model_io", model_io)
    monkeypatch.setattr(hub_push, "upload", lambda *a, **k: uploaded.append(a))
    with pytest.raises(ModelProcessFailed, match="'tokenizer.json', which is not a regular file or folder"):
        push.push_checkpoint(Workspace(tmp_path), "run", hub_push.PushTarget("hub:me/m", "me/m", None), None,
                             "merged", "2GB", None, False)
    assert uploaded == [] and staged and not staged[0].exists()
