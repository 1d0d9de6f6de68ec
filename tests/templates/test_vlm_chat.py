"""The vlm_chat template on tiny random models of real families (LLaVA 1.5, Qwen2-VL, Qwen2.5-VL,
Idefics3/SmolVLM, Gemma 3, LLaVA-OneVision, Qwen3-VL, built offline): each loads with its own processor (no torchvision here), every
example is rendered with the family's chat template and the loss covers exactly the assistant's
tokens, the data forms people keep are read, bad input is refused naming the record, and a run
learns held-out colour questions that its export answers through ``apply_chat_template``."""

from __future__ import annotations

import io
import json
import shutil
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from engine.config import ConfigError
from engine.data_files import WORKSPACE_VARIABLE, DataPathRefused
from engine.engine import IGNORE_INDEX
from engine.launch import load_recipe_class
from tests.support import REPO
from tests.vlm_families import available, each, tiny_vlm_folder

TEMPLATE = REPO / "recipes_template" / "vlm_chat"
vlm = sys.modules[load_recipe_class(TEMPLATE).__module__]

# What each family's template adds after the generation prompt for an answer: what it learns.
LEARNT = {"llava": " {} ", "qwen2_vl": "{}<|im_end|>\n", "qwen2_5_vl": "{}<|im_end|>\n",
          "idefics3": " {}<end_of_utterance>\n", "gemma3": "{}<end_of_turn>\n", "llava_onevision": "{}<|im_end|>\n",
          "qwen3_vl": "{}<|im_end|>\n"}
# The token the model's image features replace, and how many of them a 56 × 56 image takes.
IMAGE_TOKENS = {"llava": ("<image>", 16), "qwen2_vl": ("<|image_pad|>", 4), "qwen2_5_vl": ("<|image_pad|>", 4),
                "idefics3": ("<image>", 20), "gemma3": ("<image_soft_token>", 4), "llava_onevision": ("<image>", 17),
                "qwen3_vl": ("<|image_pad|>", 4)}  # Qwen3-VL's 32-pixel units: 2 × 2 of them


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm_families")
    return {family: tiny_vlm_folder(root / family, family) for family in available()}


def picture(colour=(200, 30, 30), size=(56, 56)):
    from PIL import Image

    return Image.fromarray(np.full((*size[::-1], 3), colour, dtype=np.uint8))


def conversation():
    """Two user turns with an image each, two answers."""
    return [vlm.user_turn(["What colour is it?"], 1), vlm.assistant_turn("red"),
            vlm.user_turn(["And this one?"], 1), vlm.assistant_turn("dark blue")]


@pytest.mark.parametrize("family", each())
def test_each_family_learns_exactly_its_assistant_turns_never_an_image_token(family, folders):
    processor = vlm.load_processor(str(folders[family]))
    piece = vlm.encode(processor, conversation(), [picture(), picture((0, 0, 90))], 512, "a conversation")
    tokenizer = processor.tokenizer
    targets = [t for t in piece["targets"].tolist() if t != IGNORE_INDEX]
    assert tokenizer.decode(targets) == LEARNT[family].format("red") + LEARNT[family].format("dark blue")
    # The independent count: each answer's text as the template adds it, tokenized alone.
    expected = sum(len(tokenizer(LEARNT[family].format(a), add_special_tokens=False)["input_ids"])
                   for a in ("red", "dark blue"))
    assert vlm.loss_tokens(piece) == len(targets) == expected
    image_ids = vlm.image_token_ids(processor)
    assert not image_ids & set(targets)
    ids = piece["ids"].tolist()
    token, count = IMAGE_TOKENS[family]
    assert sum(t == tokenizer.convert_tokens_to_ids(token) for t in ids) == 2 * count
    # The tokens are the chat template's own rendering, as the processor expands it.
    text = processor.apply_chat_template(conversation(), tokenize=False)
    assert ids == vlm.processor_inputs(processor, text, [picture(), picture((0, 0, 90))])["input_ids"][0].tolist()


@pytest.mark.parametrize("family", each())
def test_stages_freeze_each_familys_parts_by_their_module_names(family, folders):
    model = vlm.load_model(vlm.ModelConfig(pretrained_path=str(folders[family])))
    parts = vlm.freeze_parts(model, vlm.ModelConfig(train_vision_tower=False, train_projector=True,
                                                    train_language_model=False))
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    projector = parts["projector"]
    assert trainable and all(any(n == p or n.startswith(p + ".") for p in projector) for n in trainable)
    vision = parts["vision_tower"][0]
    assert any(n.startswith(vision + ".") and n not in trainable for n, _ in model.named_parameters())
    vlm.freeze_parts(model, vlm.ModelConfig(train_projector=False))  # the language model alone
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert "lm_head.weight" in trainable or any("embed_tokens" in n for n in trainable)
    assert not any(n == p or n.startswith(p + ".") for n in trainable for p in projector + [vision])


@pytest.mark.parametrize("family", each())
def test_a_batch_holds_images_of_several_sizes_as_each_family_takes_them(family, folders):
    """Qwen's patches of each grid, Idefics3's and OneVision's tiles (padded with all-zero
    tiles the model drops), one LLaVA or Gemma image each: one batch, one forward."""
    processor = vlm.load_processor(str(folders[family]))
    model = vlm.load_model(vlm.ModelConfig(pretrained_path=str(folders[family])))
    messages = [vlm.user_turn(["What colour?"], 1), vlm.assistant_turn("red")]
    pieces = [vlm.encode(processor, messages, [picture(size=size)], 512, "x") for size in ((56, 56), (30, 90), (90, 30))]
    batch = vlm.collate(pieces, processor)
    logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
    assert logits.shape[:2] == batch["input_ids"].shape and torch.isfinite(logits).all()
    assert int((batch["labels"] != IGNORE_INDEX).sum()) == sum(vlm.loss_tokens(p) for p in pieces)

@pytest.mark.parametrize("family", each())
def test_the_loss_maps_only_the_learnt_tokens_to_logits_and_qwens_positions_are_computed_once(family, folders):
    """compute_loss equals the loss over every position's logits, though the head maps only the
    learnt tokens; Qwen's 3-D positions, computed once per example, are those the model computes
    for the padded batch."""
    processor = vlm.load_processor(str(folders[family]))
    model = vlm.load_model(vlm.ModelConfig(pretrained_path=str(folders[family])))
    pieces = [vlm.encode(processor, m, i, 512, w) for w, m, i in vlm.builtin_examples(3, 56)]
    pieces.append(vlm.encode(processor, conversation(), [picture(), picture(size=(30, 90))], 512, "two images"))
    rope_index = vlm.rope_index_of(model)
    assert (rope_index is not None) == family.startswith("qwen")
    plain, batch = vlm.collate(pieces, processor), vlm.collate([vlm.with_positions(p, rope_index) for p in pieces], processor)
    if rope_index is not None:
        grids = {k: plain[k] for k in ("image_grid_thw",)}
        expected, _ = rope_index(plain["input_ids"], plain["mm_token_type_ids"], attention_mask=plain["attention_mask"], **grids)
        assert torch.equal(batch["position_ids"], expected)
    else:
        assert "position_ids" not in batch
    every = model(**{k: v for k, v in plain.items() if k != "labels"}, use_cache=False).logits
    expected_loss = torch.nn.functional.cross_entropy(every.flatten(0, 1), plain["labels"].flatten(), reduction="sum")
    learnt = batch["labels"] != IGNORE_INDEX
    with vlm.logits_only_at(model, learnt):
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}, use_cache=False).logits
    assert logits.shape == (int(learnt.sum()), every.shape[-1]) == (sum(vlm.loss_tokens(p) for p in pieces), every.shape[-1])
    loss = vlm.VLMChat.compute_loss(SimpleNamespace(model=model), batch)
    assert torch.allclose(loss, expected_loss, rtol=1e-5), (loss, expected_loss)


def test_a_processor_that_takes_video_loads_without_torchvision_and_saves_as_its_own_class(folders, tmp_path):
    processor = vlm.load_processor(str(folders["qwen2_vl"]))
    assert type(processor).__name__ == "Qwen2VLProcessor" and processor.chat_template.startswith("{% set image_count")
    processor.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "processor_config.json").read_text())["processor_class"] == "Qwen2VLProcessor"
    if not vlm.torchvision_available():
        from transformers import AutoProcessor

        with pytest.raises(Exception):  # transformers' own route builds the video processor
            AutoProcessor.from_pretrained(folders["qwen2_vl"])


def test_a_folder_without_a_processor_or_of_a_text_model_is_refused_naming_the_family(folders, tmp_path):
    bare = tmp_path / "bare"
    shutil.copytree(folders["llava"], bare)
    (bare / "processor_config.json").unlink()
    with pytest.raises(ConfigError, match=r"model.pretrained_path=.*bare \(llava\) has no processor: its image "
                                          r"processor's settings \(preprocessor_config.json or processor_config.json\) "
                                          r"is missing; save the model's processor beside it"):
        vlm.load_processor(str(bare))
    (bare / "processor_config.json").write_text(json.dumps({"processor_class": "NoSuchProcessor"}))
    with pytest.raises(ConfigError, match=r"\(llava\) needs the processor NoSuchProcessor, which transformers"):
        vlm.load_processor(str(bare))
    from tests.model_families import tiny_model_folder

    text = tiny_model_folder(tmp_path / "text", "qwen2")
    with pytest.raises(ConfigError, match="is a qwen2 model, which AutoModelForImageTextToText does not load"):
        vlm.load_model(vlm.ModelConfig(pretrained_path=str(text)))


# ---------------------------------------------------------------------------------------------
# Data in the forms people keep
# ---------------------------------------------------------------------------------------------


def png_bytes(colour) -> bytes:
    buffer = io.BytesIO()
    picture(colour, (20, 30)).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture
def data(tmp_path, monkeypatch):
    """A workspace with two images and the same two conversations in each form."""
    monkeypatch.setenv(WORKSPACE_VARIABLE, str(tmp_path))
    folder = tmp_path / "data"
    (folder / "images").mkdir(parents=True)
    for name, colour in (("red", (200, 30, 30)), ("blue", (30, 30, 200))):
        (folder / "images" / f"{name}.png").write_bytes(png_bytes(colour))
    llava = [{"id": name, "image": f"images/{name}.png", "conversations": [
        {"from": "human", "value": "<image>\nWhat colour is it?"}, {"from": "gpt", "value": name}]}
        for name in ("red", "blue")]
    (folder / "llava.json").write_text(json.dumps(llava))
    (folder / "llava.jsonl").write_text("".join(json.dumps(r) + "\n" for r in llava))
    messages = [{"messages": [{"role": "user", "content": [{"type": "image", "image": f"images/{name}.png"},
                                                           {"type": "text", "text": "What colour is it?"}]},
                              {"role": "assistant", "content": name}]} for name in ("red", "blue")]
    (folder / "messages.jsonl").write_text("".join(json.dumps(r) + "\n" for r in messages))
    (folder / "captions.jsonl").write_text("".join(json.dumps({"image": f"images/{n}.png", "caption": n}) + "\n"
                                                   for n in ("red", "blue")))
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({
        "images": [[{"bytes": png_bytes((200, 30, 30)), "path": None}], [{"bytes": png_bytes((30, 30, 200)), "path": None}]],
        # TRL's form: bare image parts take the record's images in order; every content a list of parts.
        "messages": [[{"role": "user", "content": [{"type": "image", "text": None},
                                                   {"type": "text", "text": "What colour is it?"}]},
                      {"role": "assistant", "content": [{"type": "text", "text": name}]}] for name in ("red", "blue")],
    })
    pq.write_table(table, folder / "messages.parquet")
    return folder


EXPECTED = [
    [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is it?"}]},
     {"role": "assistant", "content": [{"type": "text", "text": name}]}] for name in ("red", "blue")
]


@pytest.mark.parametrize("name, fmt", [("llava.json", "llava"), ("llava.jsonl", "llava"),
                                       ("messages.jsonl", "messages"), ("messages.parquet", "messages")])
def test_each_form_becomes_the_same_messages_with_their_images(data, name, fmt):
    examples, formats = vlm.load_examples(vlm.VLMChatDataConfig(paths=[str(data / name)]))
    assert formats == [fmt]
    assert [where for where, _, _ in examples] == [f"{name}:1", f"{name}:2"]
    assert [messages for _, messages, _ in examples] == EXPECTED
    assert [np.asarray(images[0].open())[0, 0].tolist() for _, _, images in examples] == [[200, 30, 30], [30, 30, 200]]


def test_captions_are_asked_the_caption_prompt(data):
    cfg = vlm.VLMChatDataConfig(paths=[str(data / "captions.jsonl")], caption_prompt="What colour is it?")
    examples, formats = vlm.load_examples(cfg)
    assert formats == ["caption"] and [m for _, m, _ in examples] == EXPECTED


def test_several_images_go_where_their_placeholders_are(data):
    record = {"images": ["images/red.png", "images/blue.png"], "conversations": [
        {"from": "human", "value": "<image> first, then <image>: which is red?"}, {"from": "gpt", "value": "the first"}]}
    (data / "two.jsonl").write_text(json.dumps(record) + "\n")
    ((_, messages, images),), _ = vlm.load_examples(vlm.VLMChatDataConfig(paths=[str(data / "two.jsonl")]))
    assert messages[0]["content"] == [{"type": "image"}, {"type": "text", "text": "first, then"}, {"type": "image"},
                                      {"type": "text", "text": ": which is red?"}]
    assert len(images) == 2


BAD = [
    ({"image": "images/none.png", "conversations": [{"from": "human", "value": "<image>"}, {"from": "gpt", "value": "x"}]},
     ConfigError, r"bad.jsonl:1: image 'images/none.png' cannot be read \(no such file: .*none.png\)"),
    ({"image": "images/red.png", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "x"}]},
     ConfigError, r"bad.jsonl:1: 0 <image> placeholder\(s\) for 1 image\(s\); put one <image> in the conversation"),
    ({"image": "images/red.png", "conversations": [{"from": "human", "value": "<image><image>"},
                                                   {"from": "gpt", "value": "x"}]},
     ConfigError, r"bad.jsonl:1: 2 <image> placeholder\(s\) for 1 image\(s\)"),
    ({"image": "images/red.png", "conversations": [{"from": "human", "value": "<image> hi"}]},
     ConfigError, "bad.jsonl:1: the conversation has no assistant turn: nothing to learn"),
    ({"image": "../../outside.png", "caption": "x"}, DataPathRefused, "leads outside the workspace"),
    ({"image": "images/broken.png", "caption": "x"}, ConfigError, r"bad.jsonl:1: image 'images/broken.png' cannot be read"),
    ({"image": "images/bomb.png", "caption": "x"}, ConfigError,
     r"bad.jsonl:1: image 'images/bomb.png' cannot be read \(Image size .* exceeds limit"),
    ({"messages": [{"role": "user", "content": [{"type": "video"}]}]}, ConfigError,
     'bad.jsonl:1: message 1 has a video part with no "video" path'),
    ({"messages": [{"role": "user", "content": [{"type": "audio"}]}]}, ConfigError,
     "bad.jsonl:1: message 1 has a part of type 'audio'; give image, video or text parts"),
]


def bomb_png(width: int, height: int) -> bytes:
    """A tiny PNG whose header claims ``width × height`` pixels (400 M: over twice PIL's limit)."""
    import struct
    import zlib

    png = bytearray(png_bytes((0, 0, 0)))
    header = b"IHDR" + struct.pack(">II", width, height) + png[24:29]
    png[12:29], png[29:33] = header, struct.pack(">I", zlib.crc32(header))
    return bytes(png)


@pytest.mark.parametrize("record, error, message", BAD)
def test_bad_records_are_refused_naming_the_file_and_line(data, record, error, message):

    (data / "images" / "broken.png").write_bytes(b"not an image")
    (data / "images" / "bomb.png").write_bytes(bomb_png(20000, 20000))
    (data.parent.parent / "outside.png").write_bytes(png_bytes((1, 2, 3)))
    (data / "bad.jsonl").write_text(json.dumps(record) + "\n")
    with pytest.raises(error, match=message):
        vlm.load_examples(vlm.VLMChatDataConfig(paths=[str(data / "bad.jsonl")]))


def test_image_tokens_beyond_the_sequence_length_are_refused(folders):
    processor = vlm.load_processor(str(folders["idefics3"]))
    messages = [vlm.user_turn(["What colour?"], 1), vlm.assistant_turn("red")]
    text = processor.apply_chat_template(messages, tokenize=False)
    (expansion,) = vlm.processor_inputs(processor, text, [picture()], return_text_replacement_offsets=True)[
        "text_replacement_offsets"][0]
    expanded = len(processor.tokenizer(expansion["replacement"], add_special_tokens=False)["input_ids"])
    assert expanded > 20  # 4 tiles and the whole image, 4 image tokens each, and their tags
    with pytest.raises(ConfigError, match=rf"a record: the images alone take {expanded} tokens, more than data.seq_len=16"):
        vlm.encode(processor, messages, [picture()], 16, "a record")
    with pytest.raises(ConfigError, match=rf"a record: the images' tokens end at token \d+, beyond data.seq_len={expanded}"):
        vlm.encode(processor, messages, [picture()], expanded, "a record")
    whole = vlm.encode(processor, messages, [picture()], 512, "a record")
    assert not whole["truncated"]
    cut = len(whole["ids"]) - 3
    piece = vlm.encode(processor, messages, [picture()], cut, "a record")  # the answer is cut, the image kept
    assert piece["truncated"] and len(piece["ids"]) == cut + 1


def test_a_family_whose_processor_has_no_chat_template_is_refused_naming_it(folders, tmp_path):
    """A chat family whose chat template is not beside it: refused, not guessed (PaliGemma, which
    has none by design, takes its prefix/suffix form: test_vlm_chat_paligemma.py)."""
    folder = shutil.copytree(folders["llava"], tmp_path / "llava")
    (folder / "chat_template.jinja").unlink()
    with pytest.raises(ConfigError, match=r"^model.pretrained_path=.*llava \(llava\): its processor LlavaProcessor has "
                                          r"no chat template and takes no suffix \(PaliGemma's prefix/suffix form\); "
                                          r"save the model's chat_template.jinja beside it$"):
        vlm.load_processor(str(folder))


def test_a_hub_id_loads_the_snapshot_the_server_bound_and_no_model_is_refused(folders, tmp_path, monkeypatch):
    from engine.data_files import HUB_MODELS_VARIABLE

    monkeypatch.setenv(WORKSPACE_VARIABLE, str(tmp_path))  # the snapshot lies outside it, bound read-only
    monkeypatch.setenv(HUB_MODELS_VARIABLE, json.dumps({"org/tiny-smolvlm@main": str(folders["idefics3"])}))
    processor = vlm.load_processor("org/tiny-smolvlm@main")
    model = vlm.load_model(vlm.ModelConfig(pretrained_path="org/tiny-smolvlm@main"))
    assert type(processor).__name__ == "Idefics3Processor" and type(model).__name__ == "Idefics3ForConditionalGeneration"
    with pytest.raises(ConfigError, match=r"^model.pretrained_path=org/other is no folder here and no Hub snapshot"):
        vlm.load_processor("org/other")
    with pytest.raises(ConfigError, match="^model.pretrained_path is required: a workspace folder or a Hub id"):
        vlm.load_processor(None)


def test_a_saved_data_set_with_an_image_column_is_read(data):
    import datasets

    from engine.data_formats import is_saved_dataset

    rows = {"image": [picture((200, 30, 30)), picture((30, 30, 200))], "caption": ["red", "blue"]}
    saved = data / "saved"
    datasets.Dataset.from_dict(rows).cast_column("image", datasets.Image()).save_to_disk(str(saved))
    assert is_saved_dataset(saved)
    cfg = vlm.VLMChatDataConfig(paths=[str(saved)], caption_prompt="What colour is it?")
    examples, formats = vlm.load_examples(cfg)
    assert formats == ["caption"] and [m for _, m, _ in examples] == EXPECTED
    assert [np.asarray(images[0].open())[0, 0].tolist() for _, _, images in examples] == [[200, 30, 30], [30, 30, 200]]


# ---------------------------------------------------------------------------------------------
# Packing: whole examples share rows, each attending to itself alone
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", vlm.PACKS)
def test_packed_rows_give_each_family_the_loss_its_examples_have_padded(family, folders):
    """The same examples, one per padded row or packed several a row (Qwen's 3-D positions per
    example): the same loss. Attending across the examples of a row (an attention_mask over the
    whole row) changes it: the test sees it."""
    processor = vlm.load_processor(str(folders[family]))
    model = vlm.load_model(vlm.ModelConfig(pretrained_path=str(folders[family])))
    rope_index = vlm.rope_index_of(model)
    examples = vlm.builtin_examples(5, 56) + [("two", conversation(), [picture(), picture(size=(30, 90))])]
    pieces = [vlm.with_positions(vlm.encode(processor, m, i, 512, w), rope_index) for w, m, i in examples]
    inputs = [len(p["ids"]) - 1 for p in pieces]
    rows = vlm.pack(inputs, 2 * max(inputs))
    assert sorted(i for row in rows for i in row) == list(range(6)) and len(rows) < 6
    assert all(sum(inputs[i] for i in row) <= 2 * max(inputs) for row in rows)
    packed = vlm.collate_packed([[pieces[i] for i in row] for row in rows], processor)
    first = rows[0]  # its pieces' positions restart, then the padding's
    text_positions = packed["position_ids"][0, 0] if rope_index is not None else packed["position_ids"][0]
    starts = [sum(inputs[i] for i in first[:k]) for k in range(len(first) + 1)]
    assert [int(text_positions[s]) for s in starts[:-1]] == [0] * len(first)
    assert int(packed["padding"][0].sum()) == packed["input_ids"].shape[1] - starts[-1]
    me = SimpleNamespace(model=model)
    padded = vlm.VLMChat.compute_loss(me, vlm.collate(pieces, processor))
    assert abs(vlm.VLMChat.compute_loss(me, packed) - padded) <= 1e-6 * abs(padded)
    across = vlm.VLMChat.compute_loss(me, {**packed, "attention_mask": (~packed["padding"]).long()})
    assert abs(across - padded) > 5e-6 * abs(padded)


def test_packing_is_refused_for_a_family_not_checked_and_counted_in_the_data_summary(folders, tmp_path):
    other = tmp_path / "paligemma"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "paligemma"}))
    config = vlm.VLMChatConfig(model=vlm.ModelConfig(pretrained_path=str(other)), data=vlm.VLMChatDataConfig(packing=True))
    with pytest.raises(ConfigError, match=r"^data.packing=true: paligemma models are not known to keep a packed "
                                          r"example's attention to itself \(packing is checked for qwen2_vl, "):
        vlm.VLMChat.summarize_data(config)
    config = vlm.VLMChatConfig(model=vlm.ModelConfig(pretrained_path=str(folders["qwen2_vl"])),
                               data=vlm.VLMChatDataConfig(packing=True, seq_len=128, builtin_images=40, eval_fraction=0))
    summary = vlm.VLMChat.summarize_data(config)
    # 40 questions of 54-56 inputs each (a system turn, 4 image tokens): 2 a row of 128
    assert summary.format == "builtin (40 images); packed: 20 rows of 128" and summary.train_documents == 40


@pytest.mark.parametrize("family", each(("qwen3_vl",)))
def test_packing_a_real_family_not_checked_is_refused_by_the_check_and_the_run_alike(family, folders):
    """Qwen3-VL's packed rows are not checked (its deep-stacked features and interleaved 3-D
    positions): data.packing=true is refused before any data is read, as for PaliGemma."""
    from engine.config import build_config
    from engine.distributed import DistInfo

    expected = (rf"^data.packing=true: {family} models are not known to keep a packed example's attention to itself "
                rf"\(packing is checked for {', '.join(vlm.PACKS)}\); set data.packing=false$")
    config = vlm.VLMChatConfig(model=vlm.ModelConfig(pretrained_path=str(folders[family])),
                               data=vlm.VLMChatDataConfig(packing=True))
    with pytest.raises(ConfigError, match=expected):
        vlm.VLMChat.summarize_data(config)
    recipe = load_recipe_class(TEMPLATE)
    engine = recipe(build_config(recipe.config_class, None, [f"model.pretrained_path={folders[family]}", "data.packing=true",
                                                             "data.builtin_images=10"]),
                    DistInfo(0, 1, 0, torch.device("cpu"), None))
    with pytest.raises(ConfigError, match=expected):
        engine.before_train()


def test_a_packed_run_steps_through_rows_of_whole_examples(folders):
    from engine.config import build_config
    from engine.distributed import DistInfo

    recipe = load_recipe_class(TEMPLATE)
    overrides = [f"model.pretrained_path={folders['qwen2_vl']}", "data.packing=true", "data.seq_len=128",
                 "data.batch_size=4", "data.builtin_images=24", "data.eval_fraction=0", "train.max_steps=2",
                 "checkpoint.every=0", "metrics.tensorboard=false"]
    engine = recipe(build_config(recipe.config_class, None, overrides), DistInfo(0, 1, 0, torch.device("cpu"), None))
    engine.before_train()
    rows = engine.train_batches.pieces  # 24 questions of 54-56 inputs: 2 a row of 128
    assert len(rows) == 12 and all(len(row) == 2 for row in rows)
    for _ in range(2):
        ctx = engine.train_step()
        assert 8 * 54 <= ctx.num_tokens <= 8 * 56 and ctx.num_padding == ctx.num_positions - ctx.num_tokens
        assert ctx.num_padding < 4 * 20 and torch.isfinite(ctx.loss)


# ---------------------------------------------------------------------------------------------
# Images processed per batch: a run keeps references and tokens, never pixels
# ---------------------------------------------------------------------------------------------

# The first three steps' losses of a run on `sized_images` (lr 3e-3, 3 a batch, seq_len 256), measured
# with the code that encoded every example's images up front and kept their tensors (commit 4ce60db):
# keeping some pieces' image tensors and processing the others' as each batch is drawn gives the same
# batches, so the same losses.
UP_FRONT_LOSSES = {
    ("qwen2_vl", False): [6.00368595123291, 5.995721340179443, 5.942543029785156],
    ("qwen2_vl", True): [5.999200344085693, 5.9831414222717285, 5.95120096206665],
    ("llava", False): [5.998981475830078, 5.956502914428711, 5.931366443634033],
    ("llava", True): [5.987095832824707, 5.968288421630859, 5.930255889892578],
    ("idefics3", False): [6.031375408172607, 6.013327121734619, 5.960326671600342],
    ("idefics3", True): [6.011439800262451, 5.997658729553223, 5.970189571380615],
}
# The bytes of image tensors each case's run keeps (None: the template's KEPT_IMAGE_BYTES, where all 12
# fit), and how many of the 12 pieces keep theirs: under 400,000 bytes, 6 of Qwen2-VL's (56,472 or 75,288
# bytes a piece) and 5 of Idefics3's (61,440 or 102,400: the 5th too big, the 6th fits); 5 of LLaVA's 9,408 in 50,000.
KEPT = {("qwen2_vl", False): (400_000, 6), ("qwen2_vl", True): (None, 12), ("llava", False): (0, 0),
        ("llava", True): (50_000, 5), ("idefics3", False): (None, 12), ("idefics3", True): (400_000, 5)}


@pytest.fixture(scope="module")
def sized_images(tmp_path_factory):
    """A workspace with 12 LLaVA records of noise images in four sizes (Idefics3's tiles and
    Qwen's grids differ between them)."""
    from PIL import Image

    root = tmp_path_factory.mktemp("sized")
    (root / "images").mkdir()
    rng = np.random.default_rng(0)
    records = []
    for i in range(12):
        width, height = [(56, 56), (30, 90), (90, 30), (64, 48)][i % 4]
        Image.fromarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8)).save(root / "images" / f"{i}.png")
        records.append({"image": f"images/{i}.png", "conversations": [
            {"from": "human", "value": "<image>\nWhat is it?"}, {"from": "gpt", "value": f"thing {i}"}]})
    (root / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return root


@pytest.mark.parametrize("family, packing", list(UP_FRONT_LOSSES))
def test_batches_of_kept_and_drawn_image_tensors_train_as_images_processed_up_front_did(family, packing, folders, sized_images,
                                                                            monkeypatch, tmp_path_factory):
    from engine.config import build_config
    from engine.distributed import DistInfo

    monkeypatch.setenv(WORKSPACE_VARIABLE, str(tmp_path_factory.getbasetemp()))  # the models' and the data's
    recipe = load_recipe_class(TEMPLATE)
    template = sys.modules[recipe.__module__]  # load_recipe_class loads the module anew
    budget, kept = KEPT[family, packing]
    if budget is not None:
        monkeypatch.setattr(template, "KEPT_IMAGE_BYTES", budget)
    overrides = [f"model.pretrained_path={folders[family]}", f"data.packing={str(packing).lower()}", "data.seq_len=256",
                 "data.batch_size=3", f"data.paths=[{sized_images / 'data.jsonl'}]", "data.eval_fraction=0",
                 "train.max_steps=3", "train.eval_every=0", "optim.lr=0.003", "checkpoint.every=0",
                 "metrics.tensorboard=false"]
    torch.manual_seed(0)
    engine = recipe(build_config(recipe.config_class, None, overrides), DistInfo(0, 1, 0, torch.device("cpu"), None))
    engine.before_train()
    # What a run keeps of an example, in the store: its image references, tokens and grids; and, drawn
    # (here in order), its image tensors while they fit (each rank its own).
    stored = engine.train_batches.pieces.pieces if packing else engine.train_batches.pieces
    pieces = [stored[i] for i in range(len(stored))]
    assert len(pieces) == 12 and all(isinstance(i, template.ImageRef) for p in pieces for i in p["images"])
    assert {key for p in pieces for key in p["grids"]} == ({"image_grid_thw"} if family == "qwen2_vl" else set())
    assert isinstance(stored, template.StoredPieces) and len(stored.kept) == kept
    losses = [float(engine.train_step().loss) for _ in range(3)]
    assert losses == pytest.approx(UP_FRONT_LOSSES[family, packing], rel=1e-6, abs=0)


def test_a_prefetching_stream_keeping_some_image_tensors_gives_the_batches_of_one_that_keeps_none_and_resumes(folders):
    processor = vlm.load_processor(str(folders["idefics3"]))
    examples = [(f"{i}", m, [picture(size=size)]) for i, ((_, m, _), size)
                in enumerate(zip(vlm.builtin_examples(5, 56), [(56, 56), (30, 90), (90, 30), (64, 48), (40, 40)]))]
    encoded = [vlm.encode(processor, m, i, 512, w) for w, m, i in examples]
    two = sum(v.nbytes for p in encoded[:2] for v in p["inputs"].values())
    some, none = vlm.keep_image_inputs(encoded, two), vlm.keep_image_inputs(encoded, 0)
    assert [p["inputs"] is not None for p in some] == [True, True, False, False, False]
    assert all(p["inputs"] is None for p in none)

    def stream(pieces, prefetch):
        return vlm.BatchStream(pieces, processor, seed=3, micro_batch=2, dp_rank=0, dp_size=1, prefetch=prefetch)

    plain, ahead = stream(none, False), stream(some, True)
    batches = [(next(plain), next(ahead)) for _ in range(4)]  # two epochs and a half: tiles padded differently
    resumed = stream(some, True)
    resumed.load_state_dict(ahead.state_dict())
    assert ahead.state_dict() == {"position": 8}
    batches += [(next(plain), next(resumed)) for _ in range(2)]
    for expected, got in batches:
        assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)


def test_much_padding_points_at_data_packing_and_the_packing_skill_is_refused_for_it(folders, tmp_path):
    from engine.config import build_config
    from engine.distributed import DistInfo
    from engine.run_metrics import MetricRecord
    from skills import SkillRefused, apply_skill

    recipe = load_recipe_class(TEMPLATE)

    def warned(family_folder, *overrides: str) -> list[str]:
        config = build_config(recipe.config_class, None, [f"model.pretrained_path={family_folder}", *overrides])
        engine = recipe(config, DistInfo(0, 1, 0, torch.device("cpu"), None))
        messages = []
        engine.warn = messages.append
        engine.suggest_skills(MetricRecord(step=3, loss=1.0, padding_frac=0.6))
        return messages

    assert warned(folders["qwen2_vl"]) == ["60% of the positions of step 3 were padding: data.packing=true fills each "
                                           "row with whole examples, each attending to itself (this template's key)"]
    assert warned(folders["qwen2_vl"], "data.packing=true") == []  # packed already
    other = tmp_path / "paligemma"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "paligemma"}))
    assert warned(other) == []  # a family packing is not checked for: nothing to suggest

    copied = shutil.copytree(TEMPLATE, tmp_path / "vlm_chat", ignore=shutil.ignore_patterns("__pycache__"))
    before = (copied / "recipe.py").read_text()
    with pytest.raises(SkillRefused, match=r"^sequence-packing: recipe.py packs by its own config key data.packing "
                                           r"\(recipe.py:\d+\), which knows the model's family and its images; set "
                                           r"data.packing=true \(launch_run overrides or config.yaml\) instead$"):
        apply_skill("sequence-packing", copied)
    assert (copied / "recipe.py").read_text() == before
