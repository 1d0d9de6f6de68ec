"""The exported folder is a clean Hugging Face folder: its tokenizer's config says what the
tokenizer is, not how this machine loaded it."""

from __future__ import annotations

import json

from transformers import AutoTokenizer

from engine.hf_export import LOAD_TIME_KEYS, save_processing
from tests.model_families import tiny_model_folder


def test_the_exported_tokenizer_config_has_no_load_time_keys(tmp_path):
    folder = tiny_model_folder(tmp_path / "model", "qwen2")
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    tokenizer.save_pretrained(tmp_path / "as-saved")
    as_saved = json.loads((tmp_path / "as-saved" / "tokenizer_config.json").read_text())
    leaked = [key for key in LOAD_TIME_KEYS if key in as_saved]
    save_processing(tokenizer, tmp_path / "exported")
    exported = json.loads((tmp_path / "exported" / "tokenizer_config.json").read_text())
    assert not any(key in exported for key in LOAD_TIME_KEYS)
    assert {k: v for k, v in as_saved.items() if k not in leaked} == exported
    reloaded = AutoTokenizer.from_pretrained(tmp_path / "exported")
    assert reloaded("hello world")["input_ids"] == tokenizer("hello world")["input_ids"]
    assert leaked, "transformers no longer writes load-time keys: this test checks nothing"
