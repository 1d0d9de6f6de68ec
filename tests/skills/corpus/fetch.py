"""Fetch the corpus of third-party training scripts: each archive by exact version from PyPI,
checked against the sha256 pinned in ``manifest.json``, and only the listed files extracted.

Nothing is vendored: the scripts live in a cache, ``$TRAINWRIGHT_CORPUS_CACHE`` or
``~/.cache/trainwright/corpus``, fetched once per machine.

    python -m tests.skills.corpus.fetch          # fetch what is missing, print where the scripts are
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import tarfile
import tempfile
import urllib.request
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


def _archive(entry: dict, root: Path) -> bytes:
    """The archive's bytes, from the cache or downloaded into it; always checked against the pin."""
    path = root / "archives" / entry["filename"]
    if path.is_file():
        data = path.read_bytes()
        if _sha256(data) == entry["sha256"]:
            return data
        path.unlink()  # a partial or altered file: fetch it again
    try:
        with urllib.request.urlopen(entry["url"], timeout=60) as response:
            data = response.read()
    except OSError as e:
        raise CorpusUnavailable(f"cannot download {entry['filename']} ({e}) and it is not in {root}") from None
    if _sha256(data) != entry["sha256"]:
        raise RuntimeError(f"{entry['filename']}: sha256 {_sha256(data)} differs from the pinned {entry['sha256']}")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
    return data


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
    """Every script of the manifest, fetched and extracted where missing."""
    root = Path(root) if root is not None else cache_dir()
    (root / "scripts").mkdir(parents=True, exist_ok=True)
    scripts = []
    for entry in manifest()["archives"]:
        data = None
        for script in entry["scripts"]:
            folder = root / "scripts" / script["id"]
            stamp = folder / ".sha256"
            if not (stamp.is_file() and stamp.read_text() == entry["sha256"]):
                data = data if data is not None else _archive(entry, root)
                _extract(entry, script, data, folder)
            scripts.append(Script(
                id=script["id"], package=entry["package"], version=entry["version"], files=tuple(script["files"]),
                explicit_loop=script["explicit_loop"], trains_transformer=script["trains_transformer"], folder=folder,
            ))
    return scripts


if __name__ == "__main__":
    found = fetch()
    print(f"{len(found)} scripts from {len({s.package for s in found})} packages in {cache_dir() / 'scripts'}")
