"""A Hugging Face Hub endpoint on 127.0.0.1 for tests (``HF_ENDPOINT``): the few routes that
``huggingface_hub``'s ``model_info`` and ``snapshot_download`` call, serving model repos built
offline. It can drop a connection midway through a file (the client must resume with a
``Range`` request), refuse a gated repo without a token, and records the requests it saw.

Pushes too, with the routes ``whoami``, ``create_repo``, ``create_branch`` and ``upload_folder``
call (``/api/whoami-v2``, ``/api/repos/create``, ``/branch/``, ``/api/validate-yaml``,
``/preupload/``: every file a regular upload, ``/commit/``: the ndjson commit), for the tokens of
:attr:`FakeHub.writers`: a token writes the namespaces listed for it (401 for an unknown token,
403 for a namespace it does not hold)."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse


@dataclass
class Repo:
    files: dict[str, bytes]  # main's
    commit: str  # main's
    gated: bool = False  # requests without "Authorization: Bearer <token>" get 401 GatedRepo
    token: str = "hf_test_valid_token"
    history: dict[str, dict[str, bytes]] = field(default_factory=dict)  # every commit's files
    branches: dict[str, str] = field(default_factory=dict)  # other branches: their commits
    private: bool = False

    def at(self, revision: str) -> tuple[str, dict[str, bytes]] | None:
        if revision == "main":
            return self.commit, self.files
        if revision in self.branches:
            return self.branches[revision], self.history[self.branches[revision]]
        return (revision, self.history[revision]) if revision in self.history else None

    def commit_files(self, branch: str, files: dict[str, bytes]) -> str:
        """A new commit on ``branch`` (main or another) with ``files`` added; its id."""
        _, before = self.at(branch) or (None, {})
        after = {**before, **files}
        commit = hashlib.sha1(repr(sorted(self.history)).encode() + b"".join(after.values())).hexdigest()
        self.history[commit] = after
        if branch == "main":
            self.commit, self.files = commit, after
        else:
            self.branches[branch] = commit
        return commit


@dataclass
class FakeHub:
    repos: dict[str, Repo] = field(default_factory=dict)
    drop_once: set[str] = field(default_factory=set)  # "repo/file": the first GET sends half, then drops
    requests: list[tuple[str, str, dict[str, str]]] = field(default_factory=list)  # (method, path, headers)
    writers: dict[str, list[str]] = field(default_factory=dict)  # token: the namespaces it may write
    readers: set[str] = field(default_factory=set)  # tokens whose role is read

    def add(self, repo_id: str, folder: Path, gated: bool = False, repo_type: str = "model") -> Repo:
        """Serve ``folder`` as a new commit on main of ``repo_id`` (a data set's key in
        :attr:`repos` is ``datasets/<repo_id>``)."""
        if repo_type == "dataset":
            repo_id = f"datasets/{repo_id}"
        files = {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
        commit = hashlib.sha1(repo_id.encode() + b"".join(files.values())).hexdigest()
        history = self.repos[repo_id].history if repo_id in self.repos else {}
        history[commit] = files  # a new main; the older commits stay served
        self.repos[repo_id] = repo = Repo(files, commit, gated, history=history)
        return repo

    def start(self) -> str:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def do_HEAD(self):
                self._serve(body=False)

            def do_GET(self):
                if urlparse(self.path).path == "/api/whoami-v2":
                    return self._whoami()
                self._serve(body=True)

            def do_POST(self):
                path = unquote(urlparse(self.path).path)
                length = int(self.headers.get("Content-Length") or 0)
                data = self.rfile.read(length)
                hub.requests.append((self.command, path, {k.lower(): v for k, v in self.headers.items()}))
                parts = path.strip("/").split("/")
                if path == "/api/validate-yaml":
                    return self._json(200, {"errors": [], "warnings": []})
                if path == "/api/repos/create":
                    payload = json.loads(data)
                    repo_id = f"{payload['organization']}/{payload['name']}"
                    if not self._may_write(repo_id):
                        return
                    if repo_id in hub.repos:
                        return self._json(409, {"error": "You already created this model repo", "url": f"/{repo_id}"})
                    hub.repos[repo_id] = Repo({}, "0" * 40, history={"0" * 40: {}},
                                              private=payload.get("visibility") == "private")
                    return self._json(200, {"url": f"http://{self.headers['Host']}/{repo_id}"})
                if parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] in ("branch", "preupload", "commit"):
                    repo_id, kind, revision = "/".join(parts[2:4]), parts[4], "/".join(parts[5:])
                    if not self._may_write(repo_id):
                        return
                    repo = hub.repos.get(repo_id)
                    if repo is None:
                        return self._json(404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"})
                    if kind == "branch":
                        if revision in repo.branches:
                            return self._json(409, {"error": "Reference already exists"})
                        repo.branches[revision] = repo.commit
                        return self._json(200, {})
                    if repo.at(revision) is None:
                        return self._json(404, {"error": "Invalid rev id"}, {"X-Error-Code": "RevisionNotFound"})
                    if kind == "preupload":
                        files = json.loads(data)["files"]
                        return self._json(200, {"files": [{"path": f["path"], "uploadMode": "regular",
                                                           "shouldIgnore": False} for f in files]})
                    lines = [json.loads(line) for line in data.splitlines() if line.strip()]
                    added = {item["value"]["path"]: base64.b64decode(item["value"]["content"])
                             for item in lines if item["key"] == "file"}
                    commit = repo.commit_files(revision, added)
                    return self._json(200, {"commitUrl": f"http://{self.headers['Host']}/{repo_id}/commit/{commit}",
                                            "commitOid": commit, "pullRequestUrl": None})
                self._json(404, {"error": "not found"})

            def _token(self) -> str | None:
                given = self.headers.get("Authorization", "")
                return given[len("Bearer "):] if given.startswith("Bearer ") else None

            def _may_write(self, repo_id: str) -> bool:
                token = self._token()
                if token not in hub.writers and token not in hub.readers:
                    self._json(401, {"error": "Invalid credentials in Authorization header"})
                    return False
                if repo_id.split("/")[0] not in hub.writers.get(token, []):
                    self._json(403, {"error": f"You don't have the rights to create a model under {repo_id}"})
                    return False
                return True

            def _whoami(self):
                token = self._token()
                hub.requests.append(("GET", "/api/whoami-v2", {k.lower(): v for k, v in self.headers.items()}))
                if token not in hub.writers and token not in hub.readers:
                    return self._json(401, {"error": "Invalid credentials in Authorization header"})
                role = "read" if token in hub.readers else "write"
                return self._json(200, {"type": "user", "name": (hub.writers.get(token) or ["reader"])[0],
                                        "auth": {"type": "access_token", "accessToken": {"role": role}}})

            def _send(self, status: int, data: bytes, headers: dict[str, str] | None = None, body: bool = True):
                self.send_response(status)
                for key, value in (headers or {}).items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if body:
                    self.wfile.write(data)

            def _json(self, status: int, payload, headers=None, body=True):
                self._send(status, json.dumps(payload).encode(), {"Content-Type": "application/json", **(headers or {})},
                           body)

            def _serve(self, body: bool):
                path = unquote(urlparse(self.path).path)
                hub.requests.append((self.command, path, {k.lower(): v for k, v in self.headers.items()}))
                parts = path.strip("/").split("/")
                prefix = ""
                if parts[:2] == ["api", "datasets"]:
                    parts, prefix = ["api", "models", *parts[2:]], "datasets/"
                elif parts[:1] == ["datasets"]:
                    parts, prefix = parts[1:], "datasets/"
                if parts[:2] == ["api", "models"] and len(parts) >= 5:
                    repo_id, kind, rest = prefix + "/".join(parts[2:4]), parts[4], parts[5:]
                    repo = self._repo(repo_id, body)
                    if repo is None:
                        return
                    found = repo.at("/".join(rest)) if rest else None
                    if found is None:
                        return self._json(404, {"error": "Invalid rev id"}, {"X-Error-Code": "RevisionNotFound"}, body)
                    commit, files = found
                    if kind == "revision":
                        return self._json(200, {
                            "id": repo_id, "modelId": repo_id, "sha": commit, "private": False,
                            "gated": "manual" if repo.gated else False,
                            "siblings": [{"rfilename": name, "size": len(data), "blobId": _oid(data)}
                                         for name, data in files.items()],
                        }, body=body)
                    if kind == "tree":
                        return self._json(200, [{"type": "file", "path": name, "size": len(data), "oid": _oid(data)}
                                                for name, data in files.items()], body=body)
                if len(parts) >= 5 and parts[2] == "resolve":
                    repo_id, filename = prefix + "/".join(parts[:2]), "/".join(parts[4:])
                    repo = self._repo(repo_id, body)
                    if repo is None:
                        return
                    found = repo.at(parts[3])
                    if found is None or filename not in found[1]:
                        return self._json(404, {"error": "Entry not found"}, {"X-Error-Code": "EntryNotFound"}, body)
                    return self._file(found[0], found[1][filename], repo_id, filename, body)
                self._json(404, {"error": "not found"}, {"X-Error-Code": "RepoNotFound"}, body)

            def _repo(self, repo_id: str, body: bool) -> Repo | None:
                repo = hub.repos.get(repo_id)
                if repo is None:
                    self._json(404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"}, body)
                    return None
                if repo.private and repo_id.split("/")[0] not in hub.writers.get(self._token() or "", []):
                    self._json(404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"}, body)
                    return None
                if repo.gated and self.headers.get("Authorization") != f"Bearer {repo.token}":
                    self._json(401, {"error": f"Access to model {repo_id} is restricted."},
                               {"X-Error-Code": "GatedRepo"}, body)
                    return None
                return repo

            def _file(self, commit: str, data: bytes, repo_id: str, filename: str, body: bool):
                headers = {"X-Repo-Commit": commit, "ETag": f'"{_oid(data)}"', "Accept-Ranges": "bytes",
                           "Content-Type": "application/octet-stream"}
                start = 0
                wanted = self.headers.get("Range", "")
                if wanted.startswith("bytes="):
                    start = int(wanted[6:].split("-")[0] or 0)
                status = 206 if start else 200
                if start:
                    headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
                key = f"{repo_id}/{filename}"
                if body and key in hub.drop_once and not start:
                    hub.drop_once.discard(key)
                    self.send_response(200)
                    for k, v in headers.items():
                        self.send_header(k, v)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data[: len(data) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                self._send(status, data[start:], headers, body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def stop(self) -> None:
        """Stop serving (a second call does nothing)."""
        if getattr(self, "server", None) is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None


@contextlib.contextmanager
def hub_environment(url: str, home: Path, token: str):
    """This process's Hugging Face variables pointed at the fake Hub ``url`` (a cache at ``home``,
    ``token``, online) while the block runs; put back as they were after it."""
    names = ("HF_ENDPOINT", "HF_HOME", "HF_TOKEN", "HF_HUB_OFFLINE")
    saved = {name: os.environ.get(name) for name in names}
    os.environ.update(HF_ENDPOINT=url, HF_HOME=str(home), HF_TOKEN=token)
    os.environ.pop("HF_HUB_OFFLINE", None)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def tiny_llama_folder(folder: Path, hidden: int = 32, layers: int = 2, vocab_extra: int = 0) -> Path:
    """A random-weight Llama with a byte-level BPE tokenizer trained here, saved as safetensors."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300 + vocab_extra, special_tokens=["<|endoftext|>", "<|pad|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = ["def add(a, b):\n    return a + b\n", "import os\nprint(os.getcwd())\n", "class A:\n    pass\n"] * 20
    backend.train_from_iterator(text, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>", pad_token="<|pad|>")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=hidden * 2,
                         num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=256, tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder
