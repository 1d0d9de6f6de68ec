"""Data files a run may read: a list of files and folders expanded into files, confined to the
workspace.

The server checks the config's paths before a launch, but a recipe reads what is on disk when
it runs, and a folder may hold a committed symlink that leads out of the workspace. So the
engine confines again, on every file it opens: each file (after links are resolved) must lie
under the allowed root, which the server passes to the run in ``TRAINWRIGHT_WORKSPACE``.
Without that variable (a person running ``python -m engine.launch`` by hand) nothing is
refused.

Every file listed is also fingerprinted (SHA-256 of its bytes) into the :class:`DataListing`
the caller passes and holds, so a run can tell whether the data it loaded is the data its launch
check counted (:meth:`DataListing.fingerprint`, :meth:`DataListing.changed`), and a tokenized
store can be keyed by it (:mod:`engine.token_store`). Torch-free.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import hashlib
import os
import stat
from pathlib import Path
import json
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

from engine.config import ConfigError

WORKSPACE_VARIABLE = "TRAINWRIGHT_WORKSPACE"
# Set by the server for a run and its launch check: the folder of the tokenized data stores
# (engine/token_store.py), the workspace's .trainwright/data-cache, bound writable.
DATA_CACHE_VARIABLE = "TRAINWRIGHT_DATA_CACHE"
STORE_META_JSON = "meta.json"  # a store's folder holds it once it is complete, written last
# Beside each store of the cache, its lock: ``<key>.lock``, held by whoever looks it up or builds
# it (engine/token_store.py) and by a removal (workspace.remove_cached_data), naming its holder.
STORE_LOCK_SUFFIX = ".lock"

# Set by the server for a run, a launch check or a model process that loads a model by Hub id
# (runner/hub.py): JSON {name as given: snapshot folder}, the folders bound read-only.
HUB_MODELS_VARIABLE = "TRAINWRIGHT_HUB_MODELS"
HUB_DATASETS_VARIABLE = "TRAINWRIGHT_HUB_DATASETS"  # likewise for data.dataset
GLOB_CHARACTERS = frozenset("*?[")
MAX_SKIPPED_SHOWN = 10


class DataPathRefused(ConfigError):
    """A data path that leads outside the workspace; the message names it."""


@dataclass
class DataListing:
    """What one reading of a run's data listed: every data file with the SHA-256 of its bytes
    when listed, and what was left out with why (an extension the recipe does not read, an empty
    file, a link to nothing or to what is not a regular file). The reader returns or fills it;
    the launch check and the engine hold it."""

    files: dict[Path, str] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    hashing: bool = True  # False: the files listed, not read (a reader that only looks at their head)

    def add(self, path: Path) -> None:
        """Fingerprint ``path`` (resolved, a regular file) as part of the data: read once per
        process while its stat stays the same (:func:`_file_sha256`)."""
        self.files[path] = _file_sha256(path, reuse=True) if self.hashing else ""

    def fingerprint(self) -> str | None:
        """One SHA-256 over the paths and contents of every file listed (as they were when
        listed), or None when none was (generated data)."""
        if not self.files:
            return None
        digest = hashlib.sha256()
        for path in sorted(self.files):
            digest.update(f"{path}\0{self.files[path]}\n".encode())
        return digest.hexdigest()

    def changed(self) -> list[Path]:
        """The listed files whose bytes are no longer what they were when listed (or that are
        gone): a loader that read them in between may have read either version."""
        changed = []
        for path, digest in sorted(self.files.items()):
            try:
                if _file_sha256(path) != digest:
                    changed.append(path)
            except OSError:
                changed.append(path)
        return changed

    def skipped_report(self) -> list[str]:
        """The skipped files as lines for a data summary: the first :data:`MAX_SKIPPED_SHOWN`,
        and how many more."""
        lines = [f"{name}: {why}" for name, why in list(self.skipped.items())[:MAX_SKIPPED_SHOWN]]
        if len(self.skipped) > MAX_SKIPPED_SHOWN:
            lines.append(f"… and {len(self.skipped) - MAX_SKIPPED_SHOWN} more")
        return lines

    def summary_fields(self) -> dict[str, Any]:
        """The data summary's fields this listing fills (``fingerprint``, ``skipped``)."""
        return {"fingerprint": self.fingerprint(), "skipped": self.skipped_report()}


def store_key_of(name: str) -> str:
    """The key of a folder of the data cache: a store's (``<key>``) or a build's (``<key>.building-…``)."""
    return name.split(".", 1)[0]


@contextlib.contextmanager
def holding_store_lock(cache_fd: int, key: str, acquire: Callable[[int], None]) -> Iterator[int]:
    """Hold the lock of the store ``key`` in the cache folder ``cache_fd``: a flock on the file
    ``<key>.lock`` (created 0600, following no link, without blocking on a FIFO; a name that is not
    a regular file is refused with :class:`ConfigError`), which ``acquire(fd)`` takes (waiting,
    bounded or not, or raising). The file is there only while the lock is held: its holder removes
    it before releasing, so no lock file is left behind, and checks once it holds the lock that its
    file is still the one of that name (else it was released and removed meanwhile: it tries again)."""
    name = f"{key}{STORE_LOCK_SUFFIX}"
    while True:
        fd = _open_lock_file(cache_fd, name)
        try:
            acquire(fd)
            held = os.fstat(fd)
            try:
                current = os.stat(name, dir_fd=cache_fd, follow_symlinks=False)
            except FileNotFoundError:
                current = None
        except BaseException:
            os.close(fd)
            raise
        if current is not None and (current.st_dev, current.st_ino) == (held.st_dev, held.st_ino):
            break
        os.close(fd)
    try:
        yield fd
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=cache_fd)
        os.close(fd)  # closing releases the lock


def _open_lock_file(cache_fd: int, name: str) -> int:
    try:
        fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o600, dir_fd=cache_fd)
    except OSError as e:
        if e.errno not in (errno.ELOOP, errno.ENXIO, errno.EISDIR):
            raise
        fd = -1
    if fd < 0 or not stat.S_ISREG(os.fstat(fd).st_mode):
        if fd >= 0:
            os.close(fd)
        raise ConfigError(f"the data cache's {name} is not a regular file; remove it")
    return fd


def allowed_root() -> Path | None:
    """The folder a run may read data from (the workspace), or None when unconfined."""
    value = os.environ.get(WORKSPACE_VARIABLE)
    return Path(value).resolve() if value else None


def _inside(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def data_files(paths: Iterable[str], suffixes: Iterable[str], root: Path | None = None,
               listing: DataListing | None = None, fingerprint: bool = True) -> list[tuple[Path, str]]:
    """``(file, name)`` for every file in ``paths`` (folders: their files with one of
    ``suffixes``, links followed, in a fixed order). The name is relative to the folder given
    (or the file's own name), so the train/eval split does not depend on where data is stored.

    With a root (default: :func:`allowed_root`), a path that starts with ``~`` or that resolves
    outside the root — through ``..``, an absolute path or a symlink anywhere on the way — is
    refused with :class:`DataPathRefused`. Every file found is fingerprinted into ``listing``
    (``fingerprint=False``: not, nor read at all: a streamed corpus), and what was skipped
    recorded there (None: a listing of its own, dropped).
    """
    root = allowed_root() if root is None else Path(root).resolve()
    listing = DataListing() if listing is None else listing
    suffixes = set(suffixes)
    found: list[tuple[Path, str]] = []
    for raw in paths:
        raw = str(raw)
        if root is not None and raw.startswith("~"):
            raise DataPathRefused(f"data path {raw!r} starts with '~': give a path inside the workspace")
        given = Path(raw) if root is not None else Path(raw).expanduser()
        if not os.path.lexists(given) and GLOB_CHARACTERS & set(raw):
            found.extend(_glob_files(raw, root, suffixes, listing))
            continue
        real = _confined(given, raw, root)
        if real.is_dir():
            found.extend(_folder_files(given, real, raw, root, suffixes, listing))
        elif real.is_file():
            found.append((real, given.name))
        else:
            raise ConfigError(f"data path {raw!r} does not exist (relative paths start at the workspace)")
    for real, _ in found if fingerprint else ():
        listing.add(real)
    return found


def _glob_files(pattern: str, root: Path | None, suffixes: set[str], listing: DataListing) -> list[tuple[Path, str]]:
    """The files a glob matches (``notes/**/*.md``; ``**`` spans folders), listed as a folder's
    files are: confined, of the recipe's extensions (others skipped and reported), named relative
    to the folder before the first wildcard, so the split does not depend on where data lives."""
    parts = Path(pattern).parts
    fixed = next(i for i, part in enumerate(parts) if GLOB_CHARACTERS & set(part))
    base = Path(*parts[:fixed]) if fixed else Path(".")
    found: list[tuple[Path, str]] = []
    for match in sorted(glob.glob(pattern, recursive=True)):
        path = Path(match)
        shown = match
        real = _confined(path, shown, root)
        if real.is_dir():
            for target, name in _folder_files(path, real, shown, root, suffixes, listing):
                found.append((target, (path.relative_to(base) / name).as_posix()))
        elif _listable(path, real, shown, suffixes, listing.skipped):
            found.append((real, path.relative_to(base).as_posix()))
    if not found:
        skipped = f"; skipped: {'; '.join(listing.skipped_report()[:3])}" if listing.skipped else ""
        raise ConfigError(f"data path {pattern!r} matches no file the recipe reads ({', '.join(sorted(suffixes))}; "
                          f"relative paths start at the workspace){skipped}")
    return sorted(found, key=lambda item: item[1])


def _listable(path: Path, real: Path, shown: str, suffixes: set[str] | None, skipped: dict[str, str]) -> bool:
    """Whether a file found in a folder or by a glob is data; what is not is recorded with why
    (``suffixes`` None: a model folder's files, listed to be confined, not as data: only regular
    files count, nothing is recorded; ``skipped``: where what is not data is recorded)."""
    if suffixes is None:
        return real.is_file()
    if path.suffix not in suffixes:
        skipped[shown] = (f"extension {path.suffix or '(none)'} is not one this recipe reads "
                           f"({', '.join(sorted(suffixes))})")
        return False
    if not real.exists():
        skipped[shown] = "a link to nothing"
        return False
    if not real.is_file():
        skipped[shown] = "a link to something that is not a regular file" if path.is_symlink() else \
            "not a regular file"
        return False
    if real.stat().st_size == 0:
        skipped[shown] = "empty (0 bytes)"
        return False
    return True


# What this process hashed: a file's path -> (its stat then, its SHA-256). A listing of a file
# whose stat is unchanged reuses the digest: the ranks that wait for a store, then open it in
# the engine, and rank 0 counting the data, then loading it, each read the corpus once.
_hashed: dict[Path, tuple[tuple[int, ...], str]] = {}


def _stat_identity(status: os.stat_result) -> tuple[int, ...]:
    """What changes when a file's bytes do: its device, inode, size, modification and change times
    (the change time cannot be set back by hand)."""
    return (status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns, status.st_ctime_ns)


def _file_sha256(path: Path, reuse: bool = False) -> str:
    """Of a regular file: a FIFO swapped in after the listing would make the read wait for ever.
    ``reuse``: the digest this process already took of the file while its stat is the same (a
    file written while it was hashed is not kept); :meth:`DataListing.changed` always reads."""
    digest = hashlib.sha256()
    with os.fdopen(os.open(path, os.O_RDONLY | os.O_NONBLOCK), "rb") as f:
        before = os.fstat(f.fileno())
        if not stat.S_ISREG(before.st_mode):
            raise OSError(f"{path} is not a regular file")
        identity = _stat_identity(before)
        known = _hashed.get(path)
        if reuse and known is not None and known[0] == identity:
            return known[1]
        while chunk := f.read(1 << 20):
            digest.update(chunk)
        if _stat_identity(os.fstat(f.fileno())) == identity:
            _hashed[path] = (identity, digest.hexdigest())
    return digest.hexdigest()


def _confined(path: Path, raw: str, root: Path | None) -> Path:
    try:
        real = path.resolve()
    except RuntimeError:  # Python before 3.13 on a loop of links
        raise ConfigError(f"data path {raw!r} is a loop of symbolic links") from None
    if root is not None and not _inside(real, root):
        raise DataPathRefused(
            f"data path {raw!r} leads outside the workspace ({path} → {real}); "
            "data must be inside the workspace, and links in it must stay inside"
        )
    return real


def _folder_files(given: Path, real: Path, raw: str, root: Path | None, suffixes: set[str] | None,
                  listing: DataListing | None = None):
    skipped = listing.skipped if listing is not None else {}
    files = []
    seen = {real}
    for folder, dirs, names in os.walk(given, followlinks=True):
        folder = Path(folder)
        dirs.sort()
        for name in list(dirs):  # confine and de-loop the folders the walk goes into
            target = _confined(folder / name, f"{raw}/{(folder / name).relative_to(given).as_posix()}", root)
            if target in seen:
                dirs.remove(name)
            seen.add(target)
        for name in names:
            path = folder / name
            shown = f"{raw}/{path.relative_to(given).as_posix()}"
            if suffixes is not None and path.suffix not in suffixes:
                _listable(path, path, shown, suffixes, skipped)  # recorded as skipped, for its extension
                continue
            target = _confined(path, shown, root)
            if _listable(path, target, shown, suffixes, skipped):
                files.append((target, path.relative_to(given).as_posix()))
    return sorted(files, key=lambda item: item[1])


def data_file(raw: str, root: Path | None = None, listing: DataListing | None = None) -> Path:
    """One data file a data file names (an image of an image-caption record), resolved, confined
    as :func:`data_files` confines, and fingerprinted into ``listing`` with the files listed. Raises
    :class:`DataPathRefused` when it leads out, and an ``OSError`` when it is not a regular file
    (missing, a folder, a FIFO that would wait for a writer): the caller says which record."""
    root = allowed_root() if root is None else Path(root).resolve()
    if root is not None and str(raw).startswith("~"):
        raise DataPathRefused(f"data path {raw!r} starts with '~': give a path inside the workspace")
    real = _confined(Path(raw), str(raw), root)
    if not real.exists():
        raise FileNotFoundError(f"no such file: {raw}")
    if not real.is_file():
        raise OSError(f"not a regular file: {raw}")
    if listing is not None:
        listing.add(real)
    return real


def open_data_file(raw: str, root: Path | None = None, listing: DataListing | None = None) -> Any:
    """:func:`data_file`, opened for reading: the file read is the one confined, whatever is done
    to its path meanwhile. It is opened by its resolved path following no link and without waiting
    on a FIFO, then what the descriptor holds is checked: a regular file, at a path inside the
    workspace (a name swapped for a link, a FIFO or a folder's link between check and open is
    refused as :func:`data_file` refuses it, never read)."""
    real = data_file(raw, root, listing)
    fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"not a regular file: {raw}")
        _confined(Path(os.readlink(f"/proc/self/fd/{fd}")), raw, allowed_root() if root is None else Path(root).resolve())
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return open(fd, "rb")


def confined_path(raw: str, root: Path | None = None) -> str:
    """A local file or folder (model weights, a tokenizer) as a resolved path, after checking it
    and, for a folder, every file in it, as :func:`data_files` does. A value that names nothing
    on disk is a Hub id: the snapshot the server downloaded for it (:func:`hub_model_path`)."""
    root = allowed_root() if root is None else Path(root).resolve()
    if root is None:
        return raw
    if str(raw).startswith("~"):
        raise DataPathRefused(f"path {raw!r} starts with '~': give a path inside the workspace")
    given = Path(raw)
    if not os.path.lexists(given):
        return hub_model_path(raw)
    return _confined_folder(given, raw, root)


def bound_hub_path(variable: str, name: str) -> str | None:
    """The snapshot folder the server bound for the Hub id ``name`` (``variable``: the models'
    or the data sets' mapping), or None."""
    try:
        mapping = json.loads(os.environ.get(variable) or "{}")
    except ValueError:
        return None
    path = mapping.get(name) if isinstance(mapping, dict) else None
    return path if isinstance(path, str) and os.path.isdir(path) else None


def hub_model_path(raw: str) -> str:
    """The snapshot folder the server downloaded for the Hub id ``raw`` (a workspace folder of
    that name wins, see :func:`confined_path`), else ``raw`` as given: outside trainwright's
    server, transformers looks it up in the local Hugging Face cache itself."""
    path = bound_hub_path(HUB_MODELS_VARIABLE, raw)
    if path is not None:
        return path
    if "@" in raw and "/" in raw:  # org/name@revision: transformers takes the revision apart
        raise ConfigError(f"model.pretrained_path {raw!r}: a Hub id with a revision is resolved by trainwright's "
                          "server (launch_run); outside it, give the model's folder")
    return raw


def _confined_folder(given: Path, raw: str, root: Path) -> str:
    real = _confined(given, str(raw), root)
    if real.is_dir():
        _folder_files(given, real, str(raw), root, suffixes=None)
    return str(real)


def confined_file(path: Path, root: Path | None = None) -> Path | None:
    """``path`` resolved when it is a regular file inside the root (default :func:`allowed_root`),
    else None; not fingerprinted (a file read for what it describes, not as data)."""
    root = allowed_root() if root is None else Path(root).resolve()
    try:
        real = _confined(Path(path), str(path), root)
    except ConfigError:
        return None
    return real if real.is_file() else None


def json_value(data: bytes, where: str, what: str, line_numbers: bool = False) -> Any:
    """``data`` parsed as JSON. Text that is not JSON in UTF-8, nests too deep to parse, or holds
    a lone surrogate no tokenizer takes (``"\\ud800"``) is a :class:`ConfigError` naming
    ``where`` (and the line, with ``line_numbers``) and ``what`` was expected."""
    try:
        value = json.loads(data.decode("utf-8"))
        json.dumps(value, ensure_ascii=False).encode("utf-8")  # a lone surrogate fails here
    except json.JSONDecodeError as e:
        raise ConfigError(f"{where}{f':{e.lineno}' if line_numbers else ''}: not {what} ({e.msg})") from None
    except UnicodeError as e:
        raise ConfigError(f"{where}: not JSON text in UTF-8 ({type(e).__name__})") from None
    except RecursionError:
        raise ConfigError(f"{where}: JSON nested too deep to read") from None
    return value


@dataclass(frozen=True)
class LineRange:
    """Lines of a file: from byte ``start`` (the start of line ``first_line``) up to byte ``end``
    (the start of a later line; None: the file's end)."""

    start: int = 0
    end: int | None = None
    first_line: int = 1


def line_ranges(path: Path, count: int) -> list[LineRange]:
    """``path`` cut at line starts into at most ``count`` ranges of about equal bytes, in order:
    what workers read apart, as one reader reads the whole file (the same lines, the same line
    numbers). The newlines before each cut are counted once, here."""
    size = path.stat().st_size
    ranges, start, line = [], 0, 1
    with open(path, "rb") as f:
        for k in range(1, max(1, count)):
            share_end = size * k // count
            if share_end < 1:
                continue
            f.seek(share_end - 1)
            cut = share_end - 1 + len(f.readline())  # the first line start at or after the k-th share's end
            if cut <= start or cut >= size:
                continue
            ranges.append(LineRange(start, cut, line))
            line += _newlines(f, start, cut)
            start = cut
    return [*ranges, LineRange(start, None, line)]


def _newlines(f, start: int, end: int) -> int:
    f.seek(start)
    count, left = 0, end - start
    while left > 0 and (chunk := f.read(min(left, 1 << 24))):
        count, left = count + chunk.count(b"\n"), left - len(chunk)
    return count


def jsonl_records(path: Path, name: str, lines: LineRange = LineRange()) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(where, record)`` for each non-blank line of a ``.jsonl`` data file (of its ``lines``),
    ``where`` being ``name:line``. A line that is not a JSON object in UTF-8 — or nests too deep to
    parse, or holds a lone surrogate no tokenizer takes — is a :class:`ConfigError` that names it.
    The one reader of JSONL data for every template."""
    with open(path, "rb") as f:
        f.seek(lines.start)
        at = lines.start
        for line_number, line in enumerate(f, lines.first_line):
            if lines.end is not None and at >= lines.end:
                break
            at += len(line)
            if not line.strip():
                continue
            where = f"{name}:{line_number}"
            record = json_value(line, where, "a JSON object")
            if not isinstance(record, dict):
                raise ConfigError(f"{where}: a record must be a JSON object, got {type(record).__name__}")
            yield where, record
