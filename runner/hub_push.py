"""An export pushed to the Hugging Face Hub: ``export_checkpoint(to="hub:org/name[@branch]")``.

The export itself runs where every model process runs, in the run sandbox, into a staging
folder outside the workspace; the upload happens here, in the server process, with a token
only the server holds: ``HF_TOKEN`` in the environment of ``trainwright serve``, else the
``hf auth login`` token (as :mod:`runner.hub`'s downloads). It is never in the trusted settings,
whose limits every run records in its ``run.json``; it never enters a sandbox (the export's
process gets no variable that holds it, whatever ``runs.pass_env`` says), and every text that
leaves this module — errors included — has it scrubbed by value.

Refused as :class:`~engine.errors.BadInput` before anything is exported: no token, the Hub
offline (``HF_HUB_OFFLINE``) or unreachable, a token the Hub does not accept or that can only
read. A repo the token cannot write (401/403 when the repo or the commit is created) is refused
after the export, which is then discarded.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from engine.errors import BadInput
from runner.hub import hub_ref, transport_errors
from sandbox.redact import MASK, redact

HUB_PREFIX = "hub:"
TOKEN_VARIABLES = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")
COMMIT_MESSAGE = "Upload {what} from trainwright run {run_id} (step {step})"


@dataclass(frozen=True)
class PushTarget:
    """``hub:org/name`` or ``hub:org/name@branch`` as given."""

    given: str
    repo_id: str
    branch: str | None

    @property
    def shown(self) -> str:
        return f"{HUB_PREFIX}{self.repo_id}" + (f"@{self.branch}" if self.branch else "")


def push_target(to: str) -> PushTarget | None:
    """The Hub repo ``to`` names (``hub:org/name[@branch]``), or None for a workspace folder."""
    if not to.startswith(HUB_PREFIX):
        return None
    ref = hub_ref(to[len(HUB_PREFIX):], None)  # never a workspace folder, whatever the workspace holds
    if ref is None:
        raise BadInput(f"to {to[:200]!r} is not a Hub repo: give hub:org/name or hub:org/name@branch "
                       "(letters, digits, '-', '_', '.'), or a folder in the workspace")
    if ref.revision is not None and re.fullmatch(r"[0-9a-f]{40}", ref.revision):
        raise BadInput(f"to {to!r} names a commit; a push goes to a branch: hub:{ref.repo_id}@BRANCH")
    return PushTarget(to, ref.repo_id, ref.revision)


def server_token(environ: Mapping[str, str] | None = None) -> str:
    """The server's Hub token: ``HF_TOKEN`` (or ``HUGGING_FACE_HUB_TOKEN``) of its environment,
    else the token ``hf auth login`` stored; refused when there is none or the Hub is offline."""
    env = os.environ if environ is None else environ
    if env.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE"):
        raise BadInput("the server runs with HF_HUB_OFFLINE set, so it cannot push to the Hub; export to a "
                       "workspace folder instead, or restart the server without HF_HUB_OFFLINE")
    for variable in TOKEN_VARIABLES:
        if env.get(variable, "").strip():
            return env[variable].strip()
    from huggingface_hub import get_token

    token = get_token() if environ is None else None
    if not token:
        raise BadInput("the server has no Hugging Face token, so it cannot push: start `trainwright serve` with "
                       "HF_TOKEN (a write token) in its environment, or run `hf auth login` as its user")
    return token


def scrub(text: str, token: str) -> str:
    """``text`` without the token (by value, whatever the redactor collected) and other secrets."""
    return redact(text.replace(token, MASK))


def token_variables(token: str, environ: Mapping[str, str] | None = None) -> set[str]:
    """The server's variables that hold the token: never passed to a sandbox."""
    env = os.environ if environ is None else environ
    return {name for name, value in env.items() if name in TOKEN_VARIABLES or (value and token in value)}


def _api(token: str, environ: Mapping[str, str] | None) -> Any:
    from huggingface_hub import HfApi

    env = os.environ if environ is None else environ
    return HfApi(endpoint=env.get("HF_ENDPOINT") or None, token=token)


def check_access(target: PushTarget, token: str, environ: Mapping[str, str] | None = None) -> str:
    """The user the token belongs to; refused when the Hub cannot be reached, does not accept the
    token, or says it can only read."""
    api = _api(token, environ)
    try:
        identity = api.whoami(token=token)
    except Exception as e:
        raise _refusal(e, target, token, api.endpoint, "check the server's token") from None
    role = ((identity.get("auth") or {}).get("accessToken") or {}).get("role")
    if role == "read":
        raise BadInput(f"the server's Hugging Face token can only read, so it cannot push to {target.shown}: "
                       "give the server a write token (HF_TOKEN)")
    return str(identity.get("name") or "")


def upload(folder: Path, target: PushTarget, token: str, private: bool, message: str,
           environ: Mapping[str, str] | None = None) -> str:
    """Create the repo (``private`` when it is new) and the branch where needed, upload
    ``folder`` as one commit and return its id."""
    api = _api(token, environ)
    try:
        api.create_repo(target.repo_id, private=private, exist_ok=True)
        if target.branch:
            api.create_branch(target.repo_id, branch=target.branch, exist_ok=True)
        commit = api.upload_folder(repo_id=target.repo_id, folder_path=folder, revision=target.branch,
                                   commit_message=message)
    except Exception as e:
        raise _refusal(e, target, token, api.endpoint, "nothing was pushed") from None
    return str(commit.oid)


def _refusal(error: Exception, target: PushTarget, token: str, endpoint: str, then: str) -> BadInput:
    """The Hub's answer as a :class:`BadInput` that says what to change, the token scrubbed."""
    from huggingface_hub import errors as hf_errors

    status = getattr(getattr(error, "response", None), "status_code", None)
    first = scrub(str(error).splitlines()[0] if str(error) else type(error).__name__, token)[:300]
    if status in (401, 403):
        return BadInput(f"the Hub refused the server's token for {target.shown} (HTTP {status}): it cannot write "
                        f"there; push to a repo the token may write, or give the server another token; {then} "
                        f"({first})")
    if isinstance(error, hf_errors.HfHubHTTPError):
        return BadInput(f"the Hub refused the push to {target.shown}: {first}; {then}")
    if isinstance(error, transport_errors()):
        return BadInput(f"the Hub at {endpoint} cannot be reached ({type(error).__name__}: {first}); check the "
                        f"network and HF_ENDPOINT; {then}")
    if isinstance(error, ValueError):  # huggingface_hub's own checks (a README's metadata, a token)
        return BadInput(f"the push to {target.shown} was refused: {first}; {then}")
    raise error
