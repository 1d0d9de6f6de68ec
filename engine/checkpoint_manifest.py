"""What verifies a checkpoint: its manifest, each file's size and SHA-256 (torch-free; the server
reads it).

A save writes its files, then (rank 0, after every rank is done) ``manifest.json``: the path,
size and SHA-256 of every file in the checkpoint folder, written last, before the folder is
published under its final name (:mod:`engine.checkpoint`). A checkpoint is complete only with a
manifest whose files are all there at their sizes (:func:`problem` with ``full=False``: a stat
per file, cheap enough for every listing); before its tensors are loaded — a resume, an export,
a sample, an evaluation — every file's digest is checked too (``full=True``: SHA-256 reads
~1.4 GB/s on one core here). So a flipped byte, a truncated or missing file, a manifest that
was cut or rewritten are each named, instead of a resume that trains on NaN or a raw
``CheckpointException``.

The manifest is written by the run, so it guards against faults (disks, copies, kills), not
against the run's own code, which could write a matching manifest for any bytes.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import stat
from pathlib import Path, PurePosixPath

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from engine.run_files import open_beneath

MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
MAX_MANIFEST_BYTES = 1 << 20
MAX_FILES = 4_096  # a DCP checkpoint holds a file per rank and its metadata
_CHUNK = 1 << 20


class ManifestFile(BaseModel):
    model_config = ConfigDict(defer_build=True, extra="forbid", strict=True)

    path: str = Field(max_length=500, pattern=r"^[^\x00]+$")
    bytes: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class Manifest(BaseModel):
    model_config = ConfigDict(defer_build=True, extra="forbid", strict=True)

    format: int
    files: list[ManifestFile] = Field(max_length=MAX_FILES)

    @model_validator(mode="after")
    def _each_file_once(self) -> "Manifest":
        # A file named twice would be read twice: a manifest of one file named thousands of
        # times had the server hash it thousands of times.
        paths = [entry.path for entry in self.files]
        if len(set(paths)) != len(paths):
            raise ValueError("a file is named more than once")
        return self


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(folder: Path) -> Manifest:
    """Write ``folder/manifest.json`` for every file under ``folder`` (atomically, synced)."""
    folder = Path(folder)
    files = []
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and not p.is_symlink()):
        relative = path.relative_to(folder).as_posix()
        if relative == MANIFEST:
            continue
        files.append(ManifestFile(path=relative, bytes=path.stat().st_size, sha256=sha256_of(path)))
    manifest = Manifest(format=MANIFEST_FORMAT, files=files)
    temporary = folder / (MANIFEST + ".tmp")
    with open(temporary, "w") as f:
        f.write(manifest.model_dump_json(indent=1))
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, folder / MANIFEST)
    return manifest


def _plain(relative: str) -> bool:
    parts = PurePosixPath(relative).parts
    return bool(parts) and not relative.startswith("/") and all(p not in ("", ".", "..") for p in parts)


def _beneath(folder: Path, name: str) -> int | None:
    """``folder/name`` opened from the run directory (``folder``'s grandparent, which the server
    made), one name at a time and following no link: the run writes everything below it."""
    folder = Path(folder)
    return open_beneath(folder.parent.parent, PurePosixPath(folder.parent.name, folder.name, name))


def read_manifest(folder: Path) -> Manifest | str:
    """The folder's manifest, or why it cannot be read (never through a link, bounded)."""
    fd = _beneath(folder, MANIFEST)
    if fd is None:
        return f"{MANIFEST} is missing (the save did not finish, or it was removed)"
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return f"{MANIFEST} is not a regular file"
        if info.st_size > MAX_MANIFEST_BYTES:
            return f"{MANIFEST} is {info.st_size:,} bytes (at most {MAX_MANIFEST_BYTES:,})"
        data = os.read(fd, MAX_MANIFEST_BYTES + 1)
    except OSError as e:
        return f"{MANIFEST} cannot be read ({e.strerror})"
    finally:
        os.close(fd)
    try:
        return Manifest.model_validate(json.loads(data))
    except (ValueError, ValidationError, RecursionError) as e:  # "[" * 100_000 is a RecursionError
        first = e.errors()[0]["msg"] if isinstance(e, ValidationError) else type(e).__name__
        return f"{MANIFEST} is damaged ({first})"


def _file_problem(folder: Path, entry: ManifestFile, full: bool) -> str | None:
    """What is wrong with one file of the manifest, or None. Opened beneath the run directory
    without following a link: a name the run turned into a link (or put under one) is missing,
    never a host file's size or digest."""
    if not _plain(entry.path):
        return f"{MANIFEST} names a file outside the checkpoint ({entry.path[:80]!r})"
    fd = _beneath(folder, entry.path)
    if fd is None:  # a link, or a name under one, is not there as far as the checkpoint goes
        return f"{entry.path} is missing"
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return f"{entry.path} is not a regular file"
        if info.st_size != entry.bytes:
            return f"{entry.path} has {info.st_size:,} bytes, {entry.bytes:,} when it was saved"
        if full:  # never past the size it was saved with: a file the run grows meanwhile differs
            digest, left = hashlib.sha256(), entry.bytes + 1
            while left > 0 and (chunk := os.read(fd, min(_CHUNK, left))):
                digest.update(chunk)
                left -= len(chunk)
            if digest.hexdigest() != entry.sha256:
                return (f"{entry.path} does not match the digest it was saved with "
                        f"(sha256 {digest.hexdigest()[:12]}…, saved {entry.sha256[:12]}…)")
    except OSError as e:
        return f"{entry.path} cannot be read ({e.strerror})"
    finally:
        os.close(fd)
    return None


def copy_verified(folder: Path, dest: Path) -> str | None:
    """Copy the checkpoint in ``folder`` to ``dest`` (a new folder), then verify the copy, digests
    included, against the manifest as it was read once: what is loaded from ``dest`` later is what
    was verified now, whatever whoever writes ``folder`` does meanwhile (a SLURM job starts later
    than the server checks its checkpoint). None when the copy verifies; else what is wrong, and
    ``dest`` is removed. Each file is read beneath the run directory, following no link, and at
    most one byte past its saved size; the copy is in-kernel (``copy_file_range``, a clone where
    the filesystem makes one); a copy that would not fit on ``dest``'s disk is refused first."""
    manifest = read_manifest(folder)
    if isinstance(manifest, str):
        return manifest
    dest = Path(dest)
    why = _room_for(manifest, dest)
    if why is not None:
        return why
    dest.mkdir(parents=True)
    try:
        why = next((w for w in (_copy_file(folder, entry, dest) for entry in manifest.files) if w is not None), None)
        if why is None:
            (dest / MANIFEST).write_text(manifest.model_dump_json(indent=1))
            why = problem(dest, full=True)
    except OSError as e:
        why = f"the checkpoint could not be copied to {dest} ({e.strerror})"
    if why is not None:
        shutil.rmtree(dest, ignore_errors=True)
    return why


def _room_for(manifest: Manifest, dest: Path) -> str | None:
    """Why the copy would not fit on ``dest``'s disk, or None. A file with a hole costs the run
    nothing on its disk, and its copy is written out in full: the sizes the manifest gives (which
    the copy checks) are what the copy costs."""
    total = sum(entry.bytes for entry in manifest.files)
    existing = next(p for p in (dest, *dest.parents) if p.exists())
    free = shutil.disk_usage(existing).free
    if total > free:
        return f"the checkpoint's {total:,} bytes do not fit on the disk of {existing} ({free:,} bytes free)"
    return None


def _copy_file(folder: Path, entry: ManifestFile, dest: Path) -> str | None:
    if not _plain(entry.path):
        return f"{MANIFEST} names a file outside the checkpoint ({entry.path[:80]!r})"
    fd = _beneath(folder, entry.path)
    if fd is None:
        return f"{entry.path} is missing"
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return f"{entry.path} is not a regular file"
        target = dest / entry.path
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target, "xb") as out:
            _copy_bytes(fd, out, entry.bytes + 1)  # a file grown since it was saved is told by the copy's size
    finally:
        os.close(fd)
    return None


def _copy_bytes(source: int, out, count: int) -> None:
    """At most ``count`` bytes from ``source`` onwards into ``out``: in the kernel where it can,
    else read and written here."""
    left = count
    try:
        while left > 0 and (copied := os.copy_file_range(source, out.fileno(), min(left, 1 << 30))):
            left -= copied
        return
    except OSError as e:
        if e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
            raise
    while left > 0 and (chunk := os.read(source, min(_CHUNK, left))):
        out.write(chunk)
        left -= len(chunk)


def problem(folder: Path, full: bool) -> str | None:
    """None when every file of the checkpoint in ``folder`` (``runs/<id>/checkpoints/step-N``) is
    as its manifest says (sizes; with ``full``, digests too); else what is wrong, naming the file."""
    manifest = read_manifest(folder)
    if isinstance(manifest, str):
        return manifest
    for entry in manifest.files:  # every size first: a missing file is named before any digest is read
        why = _file_problem(folder, entry, full=False)
        if why is not None:
            return why
    for entry in manifest.files if full else ():
        why = _file_problem(folder, entry, full=True)
        if why is not None:
            return why
    return None
