"""Attack on the images sample(images=[...]) shows a vision-language model (read by vlm_chat's
read_image in the sandboxed model process): a PNG of a few KB that decodes to ~100 million
pixels. PIL only warns between its limit (MAX_IMAGE_PIXELS, ~89 M) and twice it, where it
refuses; in that band the image was decoded (12,000 × 8,000: 11 KB on disk, ~460 MB more peak
memory before the processor's own copies). It is refused unread, naming the image."""

from __future__ import annotations

import sys

import pytest

from engine.config import ConfigError
from engine.data_files import WORKSPACE_VARIABLE
from engine.launch import load_recipe_class
from tests.support import REPO

vlm_chat = sys.modules[load_recipe_class(REPO / "recipes_template" / "vlm_chat").__module__]


def test_an_image_past_pils_limit_but_under_twice_it_is_refused_unread(tmp_path, monkeypatch):
    from PIL import Image

    monkeypatch.delenv(WORKSPACE_VARIABLE, raising=False)
    path = tmp_path / "bomb.png"
    Image.new("1", (12_000, 8_000)).save(path)  # 96 M pixels, all zero: a few KB
    assert Image.MAX_IMAGE_PIXELS < 96_000_000 < 2 * Image.MAX_IMAGE_PIXELS
    with pytest.raises(ConfigError) as refused:
        vlm_chat.read_image(str(path), None, "image x")
    assert str(refused.value).startswith(f"image x: image {str(path)!r} cannot be read (Image size (96000000 pixels) "
                                         "exceeds limit of 89478485 pixels")


def test_an_image_under_the_limit_is_read(tmp_path):
    from PIL import Image

    path = tmp_path / "ok.png"
    Image.new("RGB", (20, 10), (200, 20, 20)).save(path)
    image = vlm_chat.read_image(str(path), None, "image x")
    assert (image.mode, image.size, image.getpixel((0, 0))) == ("RGB", (20, 10), (200, 20, 20))


def test_the_vlm_templates_data_refuses_such_an_image_naming_its_line(tmp_path, monkeypatch):
    """The image-caption template reads its data's images the same way, and had the same band."""
    import json

    from PIL import Image

    vlm = sys.modules[load_recipe_class(REPO / "recipes_template" / "vlm").__module__]
    (tmp_path / "images").mkdir()
    Image.new("1", (12_000, 8_000)).save(tmp_path / "images" / "bomb.png")
    (tmp_path / "data.jsonl").write_text(json.dumps({"image": "images/bomb.png", "caption": "a bomb"}) + "\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(WORKSPACE_VARIABLE, str(tmp_path))
    with pytest.raises(ConfigError) as refused:
        vlm.load_examples(vlm.VLMDataConfig(paths=["data.jsonl"]))
    assert str(refused.value).startswith("data.jsonl:1: image 'images/bomb.png' cannot be read (Image size (96000000 "
                                         "pixels) exceeds limit of 89478485 pixels")
