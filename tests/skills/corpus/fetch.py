"""Fetch the corpus of third-party training scripts: each archive by exact version from PyPI
(``pip download --require-hashes`` against the sha256 pinned in ``manifest.json``), and only the
listed files extracted.

Nothing is vendored: the scripts live in a cache, ``$TRAINWRIGHT_CORPUS_CACHE`` or
``~/.cache/trainwright/corpus``, fetched once per machine.

    python -m tests.skills.corpus.fetch          # fetch what is missing, print where the scripts are
"""

from __future__ import annotations

import fcntl
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

MANIFEST = Path(__file__).with_name("manifest.json")


class CorpusUnavailable(Exception):
    """An archive is neither in the cache nor downloadable (the network is down)."""


@dataclass(frozen=True)
class Script:
    id: str
    package: str
    version: str
    files: tuple[str, ...]  # member paths in the archive; the first holds the training loop
    explicit_loop: bool  # it calls backward() itself (loss / accelerator / fabric / scaler)
    trains_transformer: bool
    folder: Path  # where the files are extracted, under their base names

    @property
    def entry(self) -> Path:
        return self.folder / Path(self.files[0]).name

    @property
    def label(self) -> str:
        return f"{self.package}=={self.version}:{self.files[0]}"


def cache_dir() -> Path:
    return Path(os.environ.get("TRAINWRIGHT_CORPUS_CACHE") or Path.home() / ".cache" / "trainwright" / "corpus")


def manifest() -> dict:
    return json.loads(MANIFEST.read_text())


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _cached(entry: dict, root: Path) -> bytes | None:
    """The archive's bytes when the cache holds it with the pinned sha256."""
    path = root / "archives" / entry["filename"]
    if path.is_file():
        data = path.read_bytes()
        if _sha256(data) == entry["sha256"]:
            return data
        path.unlink()  # a partial or altered file: fetch it again
    return None


def _download(entries: list[dict], root: Path) -> None:
    """``pip download`` (the ordinary client, with the machine's index settings) of each archive
    by exact version, ``--require-hashes`` against the pinned sha256, into the cache."""
    archives = root / "archives"
    archives.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=archives, prefix=".download-") as tmp:
        requirements = Path(tmp) / "requirements.txt"
        requirements.write_text("".join(f"{e['package']}=={e['version']} --hash=sha256:{e['sha256']}\n" for e in entries))
        done = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--require-hashes",
             "--disable-pip-version-check", "--dest", tmp, "-r", str(requirements)],
            capture_output=True, text=True,
        )
        if done.returncode != 0:
            tail = " ".join(done.stderr.strip().splitlines()[-3:])
            raise CorpusUnavailable(f"pip download failed ({tail}) and {len(entries)} archive(s) are not in {archives}")
        for entry in entries:
            downloaded = Path(tmp) / entry["filename"]
            if not downloaded.is_file() or _sha256(downloaded.read_bytes()) != entry["sha256"]:
                raise RuntimeError(f"pip download did not bring {entry['filename']} with the pinned sha256")
            os.replace(downloaded, archives / entry["filename"])


def _read_member(data: bytes, filename: str, member: str) -> bytes:
    if filename.endswith(".whl") or filename.endswith(".zip"):
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            return z.read(member)
    with tarfile.open(fileobj=io.BytesIO(data)) as t:
        extracted = t.extractfile(member)
        if extracted is None:
            raise KeyError(member)
        return extracted.read()


def _extract(entry: dict, script: dict, data: bytes, folder: Path) -> None:
    """Only the listed members, under their base names, in a folder published by one rename."""
    stamp = folder / ".sha256"
    if stamp.is_file() and stamp.read_text() == entry["sha256"]:
        return
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}."))
    for member in script["files"]:
        (tmp / Path(member).name).write_bytes(_read_member(data, entry["filename"], member))
    (tmp / ".sha256").write_text(entry["sha256"])
    if folder.exists():
        shutil.rmtree(folder)
    os.replace(tmp, folder)


def fetch(root: Path | None = None) -> list[Script]:
    """Every script of the manifest, fetched and extracted where missing. One process at a time
    per cache (tests in parallel workers fetch the same cache)."""
    root = Path(root) if root is not None else cache_dir()
    (root / "scripts").mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _fetch_locked(root)


def _fetch_locked(root: Path) -> list[Script]:

    def extracted(entry: dict, script: dict) -> bool:
        stamp = root / "scripts" / script["id"] / ".sha256"
        return stamp.is_file() and stamp.read_text() == entry["sha256"]

    archives = manifest()["archives"]
    stale = [e for e in archives if not all(extracted(e, s) for s in e["scripts"])]
    missing = [e for e in stale if _cached(e, root) is None]
    if missing:
        _download(missing, root)
    scripts = []
    for entry in archives:
        data = _cached(entry, root) if entry in stale else None
        for script in entry["scripts"]:
            folder = root / "scripts" / script["id"]
            if data is not None:
                _extract(entry, script, data, folder)
            scripts.append(Script(
                id=script["id"], package=entry["package"], version=entry["version"], files=tuple(script["files"]),
                explicit_loop=script["explicit_loop"], trains_transformer=script["trains_transformer"], folder=folder,
            ))
    return scripts


if __name__ == "__main__":
    found = fetch()
    print(f"{len(found)} scripts from {len({s.package for s in found})} packages in {cache_dir() / 'scripts'}")
