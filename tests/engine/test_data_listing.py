"""A data listing says what it left out and why (extension, size, link), and takes globs."""

from __future__ import annotations

import os

import pytest

from engine import data_files as df
from engine.config import ConfigError

SUFFIXES = {".txt", ".md"}


@pytest.fixture
def notes(tmp_path, monkeypatch):
    root = tmp_path / "ws"
    (root / "notes" / "deep").mkdir(parents=True)
    for name in ("a.txt", "b.md", "deep/c.md"):
        (root / "notes" / name).write_text(f"text of {name}\n")
    (root / "notes" / "guide.rst").write_text("rst\n")
    (root / "notes" / "table.csv").write_text("a,b\n")
    (root / "notes" / "empty.txt").write_text("")
    os.symlink("nowhere.txt", root / "notes" / "broken.txt")
    os.mkfifo(root / "notes" / "pipe.txt")
    monkeypatch.chdir(root)
    yield root


def test_a_folder_listing_reports_each_skipped_file_and_why(notes):
    listing = df.DataListing()
    found = df.data_files(["notes"], SUFFIXES, root=notes, listing=listing)
    assert [name for _, name in found] == ["a.txt", "b.md", "deep/c.md"]
    assert sorted(listing.skipped) == ["notes/broken.txt", "notes/empty.txt", "notes/guide.rst",
                                          "notes/pipe.txt", "notes/table.csv"]
    assert listing.skipped["notes/guide.rst"] == "extension .rst is not one this recipe reads (.md, .txt)"
    assert listing.skipped["notes/empty.txt"] == "empty (0 bytes)"
    assert listing.skipped["notes/broken.txt"] == "a link to nothing"
    assert listing.skipped["notes/pipe.txt"] == "not a regular file"
    assert len(listing.skipped_report()) == 5


def test_globs_list_their_matches_named_from_the_folder_before_the_wildcard(notes):
    found = df.data_files(["notes/**/*.md"], SUFFIXES, root=notes)
    assert [name for _, name in found] == ["b.md", "deep/c.md"]
    assert [path for path, _ in found] == [(notes / "notes" / "b.md").resolve(), (notes / "notes/deep/c.md").resolve()]
    # A glob that matches files of other extensions: skipped and said so, as in a folder.
    with pytest.raises(ConfigError, match=r"data path 'notes/\*.rst' matches no file the recipe reads .*"
                                          r"skipped: notes/guide.rst: extension .rst"):
        df.data_files(["notes/*.rst"], SUFFIXES, root=notes)
    with pytest.raises(ConfigError, match="matches no file"):
        df.data_files(["nothing/*.txt"], SUFFIXES, root=notes)


def test_a_glob_is_confined_like_any_path(notes, tmp_path):
    (tmp_path / "secret.txt").write_text("secret")
    with pytest.raises(df.DataPathRefused):
        df.data_files(["../*.txt"], SUFFIXES, root=notes)


def test_the_data_summary_names_what_was_skipped():
    from engine import run_dir as rd

    summary = rd.DataSummary(source="files", paths=["notes"], files=3, documents=3, tokens=30, train_documents=3,
                             eval_documents=0, train_tokens=30, eval_tokens=0,
                             skipped=["notes/guide.rst: extension .rst is not one this recipe reads (.md, .txt)",
                                      "notes/empty.txt: empty (0 bytes)"])
    assert summary.describe().startswith(
        "data: files from notes: 3 files, 2 skipped (notes/guide.rst: extension .rst is not one this recipe "
        "reads (.md, .txt); …), 3 documents")


class HashedBytes:
    """Counts the bytes SHA-256 reads in ``engine.data_files`` (its ``hashlib.sha256`` wrapped)."""

    def __init__(self, monkeypatch):
        import hashlib

        self.count, real = 0, hashlib.sha256
        counter = self

        class Counting:
            def __init__(self, data: bytes = b""):
                self.digest_of = real(data)
                counter.count += len(data)

            def update(self, data: bytes) -> None:
                counter.count += len(data)
                self.digest_of.update(data)

            def hexdigest(self) -> str:
                return self.digest_of.hexdigest()

        monkeypatch.setattr(df, "hashlib", type("hashlib", (), {"sha256": Counting}))
        monkeypatch.setattr(df, "_hashed", {})


def test_a_file_is_hashed_once_per_process_while_its_stat_is_unchanged_and_again_once_rewritten(tmp_path, monkeypatch):
    import hashlib

    data = tmp_path / "corpus.txt"
    data.write_bytes(b"a" * 100_000)
    hashed = HashedBytes(monkeypatch)
    first = df.DataListing()
    df.data_files([str(data)], SUFFIXES, root=tmp_path, listing=first)
    assert hashed.count == 100_000
    second = df.DataListing()
    df.data_files([str(data)], SUFFIXES, root=tmp_path, listing=second)
    assert hashed.count == 100_000 and second.files == first.files
    assert first.changed() == [] and hashed.count == 200_000  # whether it changed is always read

    # The same size and modification time, other bytes: the change time tells.
    before = data.stat()
    data.write_bytes(b"b" * 100_000)
    os.utime(data, ns=(before.st_atime_ns, before.st_mtime_ns))
    third = df.DataListing()
    df.data_files([str(data)], SUFFIXES, root=tmp_path, listing=third)
    assert third.files[data.resolve()] == hashlib.sha256(b"b" * 100_000).hexdigest() != first.files[data.resolve()]
