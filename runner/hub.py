"""Models and data sets by Hugging Face Hub id: resolved by the trusted server, never by the sandbox.

What is said of ``model.pretrained_path`` below holds for ``data.dataset`` too (its data files
and README.md are fetched, :data:`~engine.data_files.HUB_DATASETS_VARIABLE` maps it).

``model.pretrained_path`` names a workspace folder or a Hub id (``org/name`` or
``org/name@revision``); an existing workspace folder wins, as in transformers. For a Hub id the
server (this module) finds the repo's files with the server's own credentials (``HF_TOKEN`` or
the ``hf auth login`` token, which never enter a run), checks the free disk against their sizes,
downloads them with ``huggingface_hub.snapshot_download`` into the user's Hugging Face cache
(``HF_HUB_CACHE``, ``HF_HOME``; ``HF_ENDPOINT`` and ``HF_HUB_OFFLINE`` honoured) and reports
progress on the way. The run then sees that repo's cache folder read-only, with
``HF_HUB_OFFLINE=1`` and :data:`~engine.data_files.HUB_MODELS_VARIABLE` mapping the name it was
given to the snapshot folder (:func:`engine.data_files.confined_path` reads it), so the recipe's
own ``from_pretrained`` call loads exactly the commit the server resolved. That commit is
recorded (``RunRecord.hub_models``): a resume loads the same one.

Weights are safetensors only unless the trusted settings allow pickled weights
(``runs.allow_pickled_weights``); a repo's Python files (remote code) are fetched only where
they allow ``runs.trust_remote_code``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from engine import run_dir as rd
from engine.data_files import HUB_DATASETS_VARIABLE, HUB_MODELS_VARIABLE
from engine.errors import MAX_QUOTED_CHARS, BadInput, NotFound

MODEL_KEY = "model.pretrained_path"
DATASET_KEY = "data.dataset"
# What a data set's loader reads: its data files, and README.md (its configs: subsets, splits).
DATA_SUFFIXES = (".parquet", ".json", ".jsonl", ".csv", ".tsv", ".arrow", ".txt")
_NAME = r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?"
_HUB_ID = re.compile(rf"^(?P<repo>{_NAME}/{_NAME})(?:@(?P<revision>[A-Za-z0-9][A-Za-z0-9._/-]{{0,127}}))?$")
WEIGHT_SAFE = (".safetensors",)
WEIGHT_PICKLED = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".msgpack", ".h5")
# What a causal LM needs beside its weights: config, generation config, tokenizer files, the
# safetensors index, chat templates.
SUPPORT_SUFFIXES = (".json", ".txt", ".model", ".jinja", ".tiktoken", ".vocab", ".merges")
DISK_MARGIN_BYTES = 256 * 2**20
PROGRESS_EVERY_S = 0.5

# (done, total or None, message): called from the thread that downloads.
Progress = Callable[[float, "float | None", str], None]


@dataclass(frozen=True)
class HubRef:
    """A Hub id as given: ``org/name`` or ``org/name@revision``."""

    given: str
    repo_id: str
    revision: str | None
    repo_type: str = "model"  # or "dataset"


def hub_ref(value: object, workspace: Path | None, repo_type: str = "model") -> HubRef | None:
    """The Hub id ``value`` names, or None: a value that is not shaped like one, or that names
    something in the workspace (a workspace folder wins, as in transformers; ``workspace``
    None: a name that can only be a Hub id, as a push's target)."""
    if not isinstance(value, str):
        return None
    match = _HUB_ID.fullmatch(value)
    if match is None or ".." in value or value.endswith(".git"):
        return None
    if workspace is not None and (os.path.lexists(Path(workspace) / value.split("@")[0])
                                  or os.path.lexists(Path(workspace) / value)):
        return None
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(match["repo"])  # the one definition of a repo id: huggingface_hub's
    except HFValidationError as e:
        raise BadInput(f"{value!r} is shaped like a Hub id, which huggingface_hub refuses ({e}); name a repo "
                       "as org/name[@revision], or a folder in the workspace") from None
    return HubRef(value, match["repo"], match["revision"], repo_type)


def hub_cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """The Hugging Face hub cache, as huggingface_hub finds it (read at each call)."""
    env = os.environ if environ is None else environ
    if env.get("HF_HUB_CACHE"):
        return Path(env["HF_HUB_CACHE"]).expanduser()
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def _offline(environ: Mapping[str, str]) -> bool:
    return environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")


@dataclass(frozen=True)
class ModelBinding:
    """The Hub models a run (or a check, or a model process) loads, and how its sandbox sees them."""

    models: tuple[rd.HubModel, ...] = ()

    def env(self) -> dict[str, str]:
        if not self.models:
            return {}
        env = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
        for variable, kind in ((HUB_MODELS_VARIABLE, "model"), (HUB_DATASETS_VARIABLE, "dataset")):
            mapping = {m.given: m.path for m in self.models if m.repo_type == kind}
            if mapping:
                env[variable] = json.dumps(mapping)
        return env

    def read_only(self) -> list[Path]:
        """The repos' cache folders: a snapshot's files are links into the repo's ``blobs/``."""
        return [Path(model.path).parent.parent for model in self.models]


@dataclass
class _Selection:
    files: list[str]
    total_bytes: int
    skipped: list[str] = field(default_factory=list)


def _select_data(siblings: Iterable[tuple[str, int | None]], ref: HubRef) -> _Selection:
    """A data set's data files (any folder: splits and subsets live in folders) and README.md."""
    files = list(siblings)
    chosen = sorted(n for n, _ in files if n.endswith(DATA_SUFFIXES) or n == "README.md")
    if not any(n.endswith(DATA_SUFFIXES) for n in chosen):
        raise BadInput(f"data set {ref.given} has no data files trainwright reads ({', '.join(DATA_SUFFIXES)}); "
                       f"files: {', '.join(n for n, _ in files[:8]) or 'none'}")
    sizes = dict(files)
    return _Selection(chosen, sum(int(sizes.get(n) or 0) for n in chosen))


def _select(siblings: Iterable[tuple[str, int | None]], ref: HubRef, allow_pickled: bool,
            remote_code: bool, with_weights: bool = True) -> _Selection:
    """The repo files a run needs, with their total size; refuses a repo without usable weights.
    ``with_weights=False``: the config, tokenizer and code only (an estimate builds the model from
    its config)."""
    files = list(siblings)
    names = [name for name, _ in files]
    safe = [n for n in names if n.endswith(WEIGHT_SAFE)]
    pickled = [n for n in names if n.endswith(WEIGHT_PICKLED)]
    if safe:
        weights = safe
    elif pickled and allow_pickled:
        weights = pickled
    elif pickled:
        raise BadInput(
            f"{ref.given} has only pickled weights ({', '.join(pickled[:3])}): loading them can run code. "
            "Choose a repo with .safetensors weights, or allow them in the trusted settings "
            "(runs.allow_pickled_weights: true in the server's --config file)"
        )
    else:
        weights = []
    top = [n for n in names if "/" not in n]  # subfolders hold other formats (onnx/, original/)
    support = [n for n in top if n.endswith(SUPPORT_SUFFIXES)]
    code = [n for n in top if n.endswith(".py")] if remote_code else []
    weights = [n for n in weights if n in top] if with_weights else []
    chosen = sorted(set(weights) | set(support) | set(code))
    if not any(n == "config.json" for n in chosen):
        raise BadInput(f"{ref.given} has no config.json: it is not a transformers model repo (files: "
                       f"{', '.join(names[:8]) or 'none'})")
    sizes = dict(files)
    total = sum(int(sizes.get(n) or 0) for n in chosen)
    return _Selection(chosen, total, [n for n in names if n not in chosen])


class _ProgressBar:
    """A tqdm stand-in for ``snapshot_download``'s bars: the bytes received (its "Downloading
    bytes" bar) go to a callback at most every :data:`PROGRESS_EVERY_S` (MCP progress
    notifications, the CLI's bar), against the total the repo listing gave."""

    callback: Progress | None = None
    label: str = ""
    expected: float = 0.0

    def __init__(self, *args: Any, total: float | None = None, initial: float = 0, desc: str = "",
                 **kwargs: Any) -> None:
        self.total = total
        self.n = initial
        self.counts = desc.startswith("Downloading bytes")
        self.disable = False
        self._last = 0.0

    def __enter__(self) -> "_ProgressBar":
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def __iter__(self):
        return iter(())

    def update(self, n: float | None = 1) -> None:
        self.n += n or 0
        now = time.monotonic()
        callback = type(self).callback
        if self.counts and callback is not None and now - self._last >= PROGRESS_EVERY_S:
            self._last = now
            expected = type(self).expected or None
            done = min(float(self.n), expected) if expected else float(self.n)
            shown = f"{done / 2**20:,.1f} MiB" + (f" of {expected / 2**20:,.1f} MiB" if expected else "")
            callback(done, expected, f"downloading {type(self).label}: {shown}")

    def refresh(self, *args: Any, **kwargs: Any) -> None:
        pass

    def close(self) -> None:
        pass

    def set_description(self, *args: Any, **kwargs: Any) -> None:
        pass

    set_description_str = set_postfix_str = set_postfix = set_description

    def reset(self, total: float | None = None) -> None:
        self.n, self.total = 0, total


def _bar_class(callback: Progress | None, label: str, expected: int) -> type[_ProgressBar]:
    return type("ProgressBar", (_ProgressBar,), {"callback": staticmethod(callback) if callback else None,
                                                 "label": label, "expected": float(expected)})


def resolve(ref: HubRef, *, commit: str | None = None, allow_pickled: bool = False, remote_code: bool = False,
            progress: Progress | None = None, environ: Mapping[str, str] | None = None,
            weights: bool = True) -> rd.HubModel:
    """Download (or find in the cache) the files of ``ref`` a run needs and return where they
    are. ``commit``: the exact commit to load (a resume passes the one its run recorded);
    ``weights=False``: a model's files but its weights (:func:`_select`)."""
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub import errors as hf_errors

    env = os.environ if environ is None else environ
    cache = hub_cache_dir(env)
    revision = commit or ref.revision or "main"
    endpoint = env.get("HF_ENDPOINT") or None
    token = env.get("HF_TOKEN") or None  # None: huggingface_hub's stored login, if any
    shown = ref.given if commit is None else f"{ref.repo_id}@{commit[:12]}"
    try:
        if _offline(env):
            path = snapshot_download(ref.repo_id, repo_type=ref.repo_type, revision=revision, cache_dir=cache,
                                     local_files_only=True)
            # What the cache holds is checked as a download would be: pickled weights, a repo
            # that is not a model.
            cached = [(p.relative_to(path).as_posix(), p.stat().st_size) for p in Path(path).rglob("*") if p.is_file()]
            if ref.repo_type == "model":
                _select(cached, ref, allow_pickled, remote_code, weights)
            return _model(ref, revision, Path(path), _folder_bytes(Path(path)))
        api = HfApi(endpoint=endpoint, token=token)
        info: Any = (api.dataset_info if ref.repo_type == "dataset" else api.model_info)(
            ref.repo_id, revision=revision, files_metadata=True)
        sha = info.sha or ""
        if not re.fullmatch(r"[0-9a-f]{40}", sha) or commit is not None and sha != commit:
            raise BadInput(f"the Hub gave no commit {commit or ''} for {shown} (got {sha[:50]!r})")
        siblings = [(s.rfilename, s.size) for s in (info.siblings or [])]
        selection = (_select_data(siblings, ref) if ref.repo_type == "dataset"
                     else _select(siblings, ref, allow_pickled, remote_code, weights))
        _check_disk(cache, _missing_bytes(api, ref, sha, cache, selection), shown)
        if progress is not None:
            progress(0.0, float(selection.total_bytes) or None,
                     f"downloading {shown}: {len(selection.files)} files, {selection.total_bytes / 2**20:,.1f} MiB")
        path = snapshot_download(
            ref.repo_id, repo_type=ref.repo_type, revision=sha, cache_dir=cache, allow_patterns=selection.files,
            endpoint=endpoint,
            token=token, tqdm_class=_bar_class(progress, shown, selection.total_bytes),  # type: ignore[arg-type]
            max_workers=4,
        )
        if progress is not None:
            total = float(selection.total_bytes) or None
            progress(total or 1.0, total, f"downloaded {shown} ({selection.total_bytes / 2**20:,.1f} MiB)")
    except hf_errors.GatedRepoError:
        raise BadInput(
            f"{shown} is a gated repo and the server has no access: accept its terms on the Hub, then give the "
            "server a token (HF_TOKEN in the environment of `trainwright serve`, or `hf auth login`)"
        ) from None
    except hf_errors.RepositoryNotFoundError:
        key = DATASET_KEY if ref.repo_type == "dataset" else MODEL_KEY
        raise NotFound(f"no {ref.repo_type} repo {ref.repo_id} on the Hub (or it is private and the server's token "
                       f"cannot see it); {key} may also name a folder in the workspace") from None
    except hf_errors.RevisionNotFoundError:
        raise NotFound(f"{ref.repo_id} has no revision {revision!r}") from None
    except hf_errors.LocalEntryNotFoundError:
        raise NotFound(
            f"{shown} is not in the local Hugging Face cache ({cache}) and the Hub cannot be reached"
            + (" (HF_HUB_OFFLINE is set)" if _offline(env) else "")
        ) from None
    except hf_errors.HfHubHTTPError as e:
        raise BadInput(f"the Hub refused {shown}: {str(e).splitlines()[0][:MAX_QUOTED_CHARS]}") from None
    except transport_errors() as e:  # the network, or the cache's disk
        where = f" at {endpoint}" if endpoint else ""
        raise BadInput(f"{shown} could not be downloaded: the Hub{where} cannot be reached or the cache cannot be "
                       f"written ({type(e).__name__}: {str(e)[:MAX_QUOTED_CHARS]}); check the network and HF_ENDPOINT, or use a "
                       "model already in the cache with HF_HUB_OFFLINE=1") from None
    if revision != sha:
        _remember_revision(Path(path), revision, sha)
    return _model(ref, sha, Path(path), selection.total_bytes)


def transport_errors() -> tuple[type[BaseException], ...]:
    """What a download raises when the Hub cannot be reached or the cache cannot be written:
    OSError, and the HTTP client's errors (httpx2 for huggingface_hub 2, httpx before)."""
    import importlib

    found: list[type[BaseException]] = [OSError]
    for client in ("httpx2", "httpx"):
        try:
            found.append(importlib.import_module(client).HTTPError)
        except (ImportError, AttributeError):
            pass
    return tuple(found)


def _remember_revision(snapshot: Path, revision: str, sha: str) -> None:
    """``refs/<revision>`` of the repo's cache folder, as ``snapshot_download`` keeps it (it
    writes none when given the commit), so that an offline server finds ``org/name`` again."""
    ref = snapshot.parent.parent / "refs" / revision
    try:
        if ref.is_file() and ref.read_text() == sha:
            return
        ref.parent.mkdir(parents=True, exist_ok=True)
        temporary = ref.with_name(f".{ref.name}.{os.getpid()}.tmp")
        temporary.write_text(sha)
        os.replace(temporary, ref)
    except OSError:  # a read-only cache: a later offline start looks the commit up by itself
        pass


def _model(ref: HubRef, commit: str, path: Path, size: int) -> rd.HubModel:
    commit = path.name if re.fullmatch(r"[0-9a-f]{40}", path.name) else commit
    return rd.HubModel(given=ref.given, repo_id=ref.repo_id, revision=ref.revision or "main", commit=commit,
                       path=str(path), bytes=size, repo_type=ref.repo_type)


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def _missing_bytes(api: Any, ref: HubRef, sha: str, cache: Path, selection: _Selection) -> int:
    """The bytes a download of ``selection`` would fetch: what the cache lacks
    (``snapshot_download(dry_run=True)`` says which files), or all of it where it cannot say."""
    from huggingface_hub import snapshot_download

    try:
        planned = snapshot_download(ref.repo_id, repo_type=ref.repo_type, revision=sha, cache_dir=cache,
                                    allow_patterns=selection.files, endpoint=api.endpoint, token=api.token,
                                    dry_run=True)
        return sum(int(f.file_size or 0) for f in planned if getattr(f, "will_download", True))
    except Exception:  # an older huggingface_hub, or the dry run failed: count every file
        return selection.total_bytes


def _check_disk(cache: Path, needed: int, shown: str) -> None:
    if needed == 0:  # everything is in the cache already
        return
    existing = cache
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    free = shutil.disk_usage(existing).free
    if needed + DISK_MARGIN_BYTES > free:
        raise BadInput(
            f"{shown} needs {needed / 2**30:,.2f} GiB and the Hugging Face cache ({cache}) has "
            f"{free / 2**30:,.2f} GiB free: free some space or point HF_HOME at a larger disk"
        )


def config_value(config: Mapping[str, Any] | None, key: str = MODEL_KEY) -> Any:
    """``key`` (``model.pretrained_path``, ``data.dataset``) of a config, nested or dotted."""
    if not isinstance(config, Mapping):
        return None
    if key in config:
        return config[key]
    section, name = key.split(".")
    inner = config.get(section)
    return inner.get(name) if isinstance(inner, Mapping) else None


def model_value(config: Mapping[str, Any] | None) -> Any:
    """``model.pretrained_path`` of a config, nested or dotted."""
    return config_value(config, MODEL_KEY)


def recipe_config(recipe_dir: Path, overrides: Mapping[str, Any], key: str = MODEL_KEY) -> Any:
    """The value of ``key`` that a launch will resolve: the overrides', else the recipe's
    ``config.yaml``'s (the code's default is seen by the launch check)."""
    value = config_value(overrides, key)
    if value is not None:
        return value
    path = Path(recipe_dir) / "config.yaml"
    try:
        if path.is_file() and not path.is_symlink() and path.stat().st_size <= 1 << 20:
            import yaml

            return config_value(yaml.safe_load(path.read_text()), key)
    except (OSError, ValueError, yaml.YAMLError):  # the launch check names what is wrong with it
        return None
    return None


def bind(workspace: Path, value: Any, *, dataset: Any = None, recorded: Iterable[rd.HubModel] = (),
         allow_pickled: bool = False, remote_code: bool = False, progress: Progress | None = None,
         weights: bool = True) -> ModelBinding:
    """The binding of the Hub model ``value`` and the Hub data set ``dataset`` name, where they
    name one (downloaded as needed). ``recorded``: a resumed run's, whose commits are loaded
    again; ``weights=False``: the model's config and tokenizer only."""
    recorded = list(recorded)
    bound = []
    for ref in (hub_ref(value, workspace), hub_ref(dataset, workspace, "dataset")):
        if ref is None:
            continue
        commit = next((m.commit for m in recorded if m.given == ref.given and m.repo_type == ref.repo_type), None)
        bound.append(resolve(ref, commit=commit, allow_pickled=allow_pickled, remote_code=remote_code,
                             progress=progress, weights=weights))
    return ModelBinding(tuple(bound))


def recorded_binding(models: Iterable[rd.HubModel]) -> ModelBinding:
    """The binding of a run's recorded Hub models, found again in the server's cache: run.json is
    the run's to write, so only a valid repo id and a 40-hex commit are taken from it, and the
    folder bound is the cache's own snapshot of that commit (a model the cache lost is left out:
    the recipe's code then says it cannot load it)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub import errors as hf_errors

    bound = []
    for model in list(models)[:4]:
        match = _HUB_ID.fullmatch(model.given) if isinstance(model.given, str) else None
        if match is None or match["repo"] != model.repo_id or not re.fullmatch(r"[0-9a-f]{40}", model.commit or ""):
            continue
        try:
            path = Path(snapshot_download(model.repo_id, repo_type=model.repo_type, revision=model.commit,
                                          cache_dir=hub_cache_dir(), local_files_only=True))
        except (hf_errors.LocalEntryNotFoundError, OSError, ValueError):
            continue
        bound.append(_model(HubRef(model.given, model.repo_id, match["revision"], model.repo_type), model.commit,
                            path, model.bytes))
    return ModelBinding(tuple(bound))


def verify(binding: ModelBinding, workspace: Path, config: Mapping[str, Any] | None) -> None:
    """The launch check's resolved config names the same Hub model as was bound (a recipe's code
    default could name another, which no sandbox can download)."""
    for key, kind in ((MODEL_KEY, "model"), (DATASET_KEY, "dataset")):
        ref = hub_ref(config_value(config, key), workspace, kind)
        if ref is not None and (ref.given, kind) not in {(m.given, m.repo_type) for m in binding.models}:
            raise BadInput(f"{key} {ref.given!r} comes from the recipe's code: set it in config.yaml or the "
                           "overrides, so the server can download it before the run")
