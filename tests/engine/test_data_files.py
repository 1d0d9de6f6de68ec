"""The engine re-confines every data file it opens to the workspace: through folders, links and
``~``, nothing outside is read (torch-free)."""

from __future__ import annotations

import os

import pytest

from engine.data_files import DataPathRefused, confined_path, data_files

SUFFIXES = {".txt", ".jsonl"}


@pytest.fixture
def layout(tmp_path):
    root = tmp_path / "ws"
    (root / "data" / "sub").mkdir(parents=True)
    (root / "data" / "a.txt").write_text("a")
    (root / "data" / "sub" / "b.txt").write_text("b")
    (root / "data" / "skip.bin").write_text("x")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("secret")
    return root, outside


def test_files_and_folders_expand_with_stable_names(layout):
    root, _ = layout
    os.symlink("sub", root / "data" / "again")  # a link that stays inside: followed, not repeated
    found = data_files([str(root / "data"), str(root / "data" / "a.txt")], SUFFIXES, root=root)
    assert [name for _, name in found] == ["a.txt", "again/b.txt", "a.txt"]
    assert all(path.is_relative_to(root) for path, _ in found)


@pytest.mark.parametrize("make", [
    lambda root, out: os.symlink(out / "secret.txt", root / "data" / "leak.txt"),
    lambda root, out: os.symlink(out, root / "data" / "sub" / "outdir"),
])
def test_a_link_in_a_data_folder_that_leads_out_is_refused(layout, make):
    root, outside = layout
    make(root, outside)
    with pytest.raises(DataPathRefused, match="leads outside the workspace"):
        data_files([str(root / "data")], SUFFIXES, root=root)


@pytest.mark.parametrize("value", ["~/secret.txt", "~root", "{out}/secret.txt", "../outside/secret.txt"])
def test_home_absolute_and_parent_paths_are_refused(layout, value, monkeypatch):
    root, outside = layout
    monkeypatch.chdir(root)
    with pytest.raises(DataPathRefused):
        data_files([value.format(out=outside)], SUFFIXES, root=root)
    with pytest.raises(DataPathRefused):
        confined_path(value.format(out=outside), root=root)


def test_model_folders_are_confined_file_by_file(layout):
    root, outside = layout
    (root / "model").mkdir()
    (root / "model" / "config.json").write_text("{}")
    assert confined_path(str(root / "model"), root=root) == str(root / "model")
    os.symlink(outside / "secret.txt", root / "model" / "weights.bin")
    with pytest.raises(DataPathRefused, match="weights.bin"):
        confined_path(str(root / "model"), root=root)


def test_without_a_workspace_nothing_is_refused(layout, monkeypatch):
    root, outside = layout
    monkeypatch.delenv("TRAINWRIGHT_WORKSPACE", raising=False)
    assert data_files([str(outside)], SUFFIXES) == [((outside / "secret.txt").resolve(), "secret.txt")]


def test_the_fingerprint_follows_the_bytes_of_the_files_listed(tmp_path):
    from engine.data_files import DataListing

    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.txt").write_text("one")
    listing = DataListing()
    assert listing.fingerprint() is None  # nothing listed: generated data
    data_files([str(tmp_path / "d")], suffixes={".txt"}, root=tmp_path, listing=listing)
    first = listing.fingerprint()
    assert first is not None and listing.changed() == []
    (tmp_path / "d" / "a.txt").write_text("two")  # same size, other bytes
    assert listing.changed() == [(tmp_path / "d" / "a.txt").resolve()]
    data_files([str(tmp_path / "d")], suffixes={".txt"}, root=tmp_path, listing=listing)
    assert listing.fingerprint() not in (None, first) and listing.changed() == []
    (tmp_path / "d" / "a.txt").write_text("one")
    listing = DataListing()
    data_files([str(tmp_path / "d")], suffixes={".txt"}, root=tmp_path, listing=listing)
    assert listing.fingerprint() == first
    (tmp_path / "d" / "a.txt").unlink()
    assert listing.changed() == [(tmp_path / "d" / "a.txt").resolve()]
    assert DataListing().fingerprint() is None  # a listing is a value: another one holds nothing


BAD_LINES = {
    "not_json": b"not json\n",
    "not_an_object": b"[1, 2]\n",
    "a_string": b'"prompt chosen rejected"\n',
    "not_utf8": b'{"text": "\xff\xfe"}\n',
    "too_deep": b"[" * 100_000 + b"\n",
    "lone_surrogate": b'{"text": "\\ud800"}\n',
}


@pytest.mark.parametrize("bad", sorted(BAD_LINES))
def test_every_template_refuses_a_bad_jsonl_line_naming_it(tmp_path, bad):
    """One reader for JSONL data: a bad line is a ConfigError that names the file and line, in
    every template (never a traceback in the launch check)."""
    from engine.config import ConfigError
    from engine.data_files import jsonl_records
    from recipes_template.causal_lm import recipe as causal_lm
    from recipes_template.dpo import recipe as dpo
    from recipes_template.sft import recipe as sft

    good = {"text": "a document", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
            "prompt": "q", "chosen": "a", "rejected": "b"}
    import json

    (tmp_path / "d.jsonl").write_bytes(json.dumps(good).encode() + b"\n\n" + BAD_LINES[bad])
    with pytest.raises(ConfigError, match=r"^d\.jsonl:3: "):
        list(jsonl_records(tmp_path / "d.jsonl", "d.jsonl"))
    paths = [str(tmp_path / "d.jsonl")]
    loaders = [
        lambda: causal_lm.load_documents(causal_lm.CausalLMDataConfig(paths=paths)),
        lambda: sft.load_conversations(sft.SFTDataConfig(paths=paths)),
        lambda: dpo.load_pairs(dpo.DPODataConfig(paths=paths)),
    ]
    for load in loaders:
        with pytest.raises(ConfigError, match=r"d\.jsonl:3: "):
            load()
