"""The vlm template: the loss covers exactly the caption's tokens, the align stage trains the
projector alone, runs resume bit for bit and match on two processes, and the exported folder
is a Hugging Face VLM (``LlavaForConditionalGeneration`` + ``AutoProcessor``) that captions a
held-out image."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from engine import model_io
from engine import run_dir as rd
from engine import run_checkpoints
from engine import run_metrics
from engine.config import ConfigError
from engine.data_files import DataPathRefused
from engine.engine import IGNORE_INDEX
from engine.launch import load_recipe_class
from tests.support import REPO, losses, run_engine, untimed

TEMPLATE = REPO / "recipes_template" / "vlm"
vlm = sys.modules[load_recipe_class(TEMPLATE).__module__]

SMALL = (
    "model.hidden_size=64", "model.intermediate_size=160", "model.vision_hidden_size=32", "model.vision_layers=1",
    "data.seq_len=48", "data.batch_size=4", "data.builtin_images=200", "data.eval_prompts=8",
    "train.log_every=1", "optim.warmup_steps=2", "optim.lr=3e-3", "metrics.tensorboard=false",
)
SCHEDULE = (*SMALL, "model.stage=align", "train.max_steps=8", "checkpoint.every=4", "checkpoint.keep_last=5")


def test_the_loss_covers_exactly_the_caption_tokens():
    processor = vlm.build_processor(32, 8)
    examples = vlm.builtin_examples(6, 32)
    pieces = vlm.make_pieces(examples, processor, seq_len=64)
    batch = vlm.collate(pieces, 64, processor.tokenizer.pad_token_id)
    # The processor's own expansion of "<image>" + caption: the tokens the exported model is fed.
    expected = processor(images=[image for _, image, _ in examples], text=["<image>" + c for _, _, c in examples],
                         return_tensors="pt", padding=True)
    torch.testing.assert_close(batch["pixel_values"], expected["pixel_values"], rtol=0, atol=0)
    image_tokens = (32 // 8) ** 2
    for row, ((_, _, text), (tokens, _)) in enumerate(zip(examples, pieces)):
        caption = processor.tokenizer.encode(text, add_special_tokens=False)
        assert tokens[0].tolist() == expected["input_ids"][row, : image_tokens + len(caption)].tolist() + [
            processor.tokenizer.eos_token_id]
        assert tokens[0, :image_tokens].eq(processor.image_token_id).all()
        # The label of position i is token i + 1 where that token is the caption's (or its end).
        labels = batch["labels"][row]
        supervised = (labels != IGNORE_INDEX).nonzero().flatten().tolist()
        assert supervised == list(range(image_tokens - 1, image_tokens + len(caption)))
        assert processor.tokenizer.decode(labels[supervised]) == text + "</s>"
    assert (batch["input_ids"][:, :image_tokens] == processor.image_token_id).all()


def test_the_builtin_set_is_deterministic_and_each_caption_names_its_attributes():
    first, again = vlm.builtin_examples(40, 32), vlm.builtin_examples(40, 32)
    assert all(a[2] == b[2] and np.array_equal(a[1], b[1]) for a, b in zip(first, again))
    seen = set()
    for _, image, text in first:
        assert image.shape == (32, 32, 3) and image.dtype == np.uint8
        words = vlm.attributes(text)
        assert all(len(found) == 1 for found in words.values()), text
        colour = vlm.COLOURS[next(iter(words["colour"]))]
        # The shape's pixels lie on the named side of the image.
        mask = np.abs(image.astype(int) - np.array(colour)).sum(-1) < 160
        ys, xs = mask.nonzero()
        side = next(iter(words["position"]))
        centre = {"left": xs.mean() < 14, "right": xs.mean() > 18, "top": ys.mean() < 14, "bottom": ys.mean() > 18}
        assert centre[side], (text, xs.mean(), ys.mean())
        seen.add(text)
    assert len(seen) > 20
    scores = vlm.caption_scores(["a red circle at the left", "a blue square at the top", "red"],
                                ["a red circle at the left", "a blue circle at the top", "a red circle at the left"])
    assert scores == {"caption_accuracy": 1 / 3, "shape_accuracy": 1 / 3, "colour_accuracy": 1.0,
                      "position_accuracy": 2 / 3}


def write_png(path: Path, colour=(200, 20, 20)) -> None:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (20, 24), colour).save(path)


@pytest.mark.parametrize(
    "line, expected",
    [
        ("not json", "data.jsonl:2: not a JSON object"),
        ('{"image": "images/a.png"}', 'data.jsonl:2: a record is {"image": "relative/path.png", "caption": "..."}'),
        ('{"image": 3, "caption": "x"}', 'data.jsonl:2: a record is {"image"'),
        ('{"image": "images/a.png", "caption": "  "}', "data.jsonl:2: the caption is empty"),
        ('{"image": "images/missing.png", "caption": "x"}', "data.jsonl:2: image 'images/missing.png' cannot be read"),
        ('{"image": "data.jsonl", "caption": "x"}', "data.jsonl:2: image 'data.jsonl' cannot be read"),
    ],
)
def test_bad_records_are_refused_with_their_line(tmp_path, monkeypatch, line, expected):
    monkeypatch.chdir(tmp_path)
    write_png(tmp_path / "images" / "a.png")
    (tmp_path / "data.jsonl").write_text('{"image": "images/a.png", "caption": "a red square"}\n' + line + "\n")
    cfg = vlm.VLMDataConfig(paths=["data.jsonl"])
    with pytest.raises(ConfigError) as raised:
        vlm.load_examples(cfg)
    assert expected in str(raised.value)


def test_image_files_are_read_resized_and_confined_to_the_workspace(tmp_path, monkeypatch):
    workspace = tmp_path / "ws"
    write_png(workspace / "set" / "images" / "a.png", (10, 200, 10))
    write_png(tmp_path / "outside.png")
    (workspace / "set" / "data.jsonl").write_text(
        json.dumps({"image": "images/a.png", "caption": "a green square"}) + "\n\n")
    monkeypatch.chdir(workspace)
    monkeypatch.setenv("TRAINWRIGHT_WORKSPACE", str(workspace))
    ((name, image, text),) = vlm.load_examples(vlm.VLMDataConfig(paths=["set"], image_size=16))
    assert (name, text, image.size) == ("data.jsonl:1", "a green square", (16, 16))  # kept at the model's size
    pixels = vlm.pixel_values(vlm.build_processor(16, 8), [image])
    assert pixels.shape == (1, 3, 16, 16)
    torch.testing.assert_close(pixels[0, :, 8, 8], (torch.tensor([10, 200, 10]) / 255 - 0.5) / 0.5)
    # Resizing once at load gives the very pixels the processor makes of the full-size image.
    from PIL import Image

    noise = Image.fromarray(np.random.default_rng(0).integers(0, 255, (97, 61, 3), dtype=np.uint8))
    noise.save(workspace / "set" / "images" / "a.png")
    ((_, image, _),) = vlm.load_examples(vlm.VLMDataConfig(paths=["set"], image_size=16))
    processor = vlm.build_processor(16, 8)
    assert torch.equal(vlm.pixel_values(processor, [image]), vlm.pixel_values(processor, [noise]))
    (workspace / "set" / "data.jsonl").write_text(json.dumps({"image": "../../outside.png", "caption": "x"}) + "\n")
    with pytest.raises(DataPathRefused, match="outside the workspace"):
        vlm.load_examples(vlm.VLMDataConfig(paths=["set"]))


def test_the_config_refuses_images_that_leave_no_room_for_a_caption():
    with pytest.raises(ValueError, match="not a multiple of model.patch_size=8"):
        vlm.VLMConfig.model_validate({"data": {"image_size": 36}})
    with pytest.raises(ValueError, match="leaves no room for a caption after the 16 image tokens"):
        vlm.VLMConfig.model_validate({"data": {"seq_len": 17}})
    with pytest.raises(ValueError, match="drop model.language_model_path"):
        vlm.VLMConfig.model_validate({"model": {"pretrained_path": "a", "language_model_path": "b"}})


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm")
    recipe = root / "vlm"
    shutil.copytree(TEMPLATE, recipe, ignore=shutil.ignore_patterns("__pycache__"))
    return root, recipe


@pytest.fixture(scope="module")
def reference(workspace):
    """An align-stage run of 8 steps, checkpoints at 4 and 8, with its code snapshot."""
    root, recipe = workspace
    run = run_engine(root, recipe, *SCHEDULE)
    shutil.copytree(recipe, run / rd.SNAPSHOT_DIRNAME)
    return run


def test_the_align_stage_changes_only_the_projector(reference):
    record = rd.read_run(reference)
    assert record.status == rd.COMPLETED and record.data.source == "builtin" and record.data.documents == 200
    curve = losses(reference)
    assert sorted(curve) == list(range(1, 9)) and curve[8] < curve[1]
    torch.manual_seed(0)
    engine = model_io.load_engine(reference, 8)
    trained = engine.model.state_dict()
    cls = type(engine)
    start = cls(engine.config, engine.dist)
    torch.manual_seed(engine.config.train.seed)
    initial = start.prepare_model().state_dict()
    assert trained.keys() == initial.keys()
    changed = {name for name in trained if not torch.equal(trained[name], initial[name])}
    projector = {name for name in trained if name.startswith("model.multi_modal_projector.")}
    assert changed == projector and len(projector) == 4


def test_resume_is_bit_identical(workspace, reference):
    root, recipe = workspace
    (_, checkpoint), *_ = run_checkpoints.list_checkpoints(reference)
    resumed = run_engine(root, recipe, *SCHEDULE, resume_from=checkpoint)
    expected = {s: v for s, v in losses(reference).items() if s > 4}
    assert losses(resumed) == expected


@pytest.mark.multiprocess
def test_two_processes_match_one(workspace, reference):
    root, recipe = workspace
    two = run_engine(root, recipe, *SCHEDULE, "checkpoint.every=0", "checkpoint.at_end=false", "train.eval_every=8",
                     nproc=2)
    one, both = losses(reference), losses(two)
    # Every rank captions at the evaluation (the model is sharded), rank 0 logs it.
    (scores,) = [r for r in run_metrics.read_all_metrics(two / rd.METRICS_JSONL) if "caption_accuracy" in r]
    assert scores["step"] == 8 and set(untimed(scores, derived_step_time=False)) == {"step", "caption_accuracy", "shape_accuracy", "colour_accuracy",
                                                   "position_accuracy"}
    assert sorted(both) == sorted(one)
    for step in one:
        assert abs(both[step] - one[step]) <= 1e-4 * abs(one[step]), (step, one[step], both[step])


def test_it_scaffolds_checks_and_describes_within_the_budget(tmp_path):
    from mcp_server.operations.recipe_info import MAX_DESCRIBE_BYTES, describe_recipe
    from mcp_server.operations.recipes import list_templates, scaffold_recipe
    from engine.config import describe_fields
    from mcp_server.limits import text_bytes
    from workspace.workspace import Workspace

    assert "vlm" in {t.name for t in list_templates().templates}
    ws = Workspace.open(tmp_path)
    scaffold_recipe(ws, "vlm", "captioner", {"model.stage": "align", "data.builtin_images": 50})  # the engine checks it
    described = describe_recipe(ws, "recipes/captioner")
    fields = {f.key: f.value for f in described.fields}
    assert fields["model.stage"] == "align" and "data.paths" in fields and "model.pretrained_path" in fields
    # Every key is listed (descriptions may be shortened to fit, as sft's and dpo's are).
    assert list(fields) == [f["key"] for f in describe_fields(vlm.VLMConfig())]
    assert text_bytes(described.model_dump(mode="json")) <= MAX_DESCRIBE_BYTES
    data = vlm.VLM.summarize_data(vlm.VLMConfig.model_validate({"data": {"builtin_images": 50}}))
    assert (data.source, data.documents, data.tokenizer) == ("builtin", 50, "bytes + <image>")
    assert data.tokens == sum(len(text) + 1 for _, _, text in vlm.builtin_examples(50, 32))

COLOURS = {"red": (210, 30, 30), "green": (30, 190, 40), "blue": (40, 60, 220)}


@pytest.fixture(scope="module")
def captioned(workspace):
    """A finetune run on image files (noisy colour fields of several sizes, captioned by colour)
    that learns to caption its held-out images; its code snapshot is in place."""
    from PIL import Image

    root, recipe = workspace
    folder = root / "captions"
    (folder / "images").mkdir(parents=True)
    rng = np.random.default_rng(0)
    with open(folder / "data.jsonl", "w") as f:
        for i in range(60):
            name = list(COLOURS)[i % 3]
            size = (int(rng.integers(20, 40)), int(rng.integers(20, 40)))
            pixels = np.clip(np.array(COLOURS[name]) + rng.integers(-30, 30, (*size, 3)), 0, 255).astype(np.uint8)
            Image.fromarray(pixels).save(folder / "images" / f"{i}.png")
            f.write(json.dumps({"image": f"images/{i}.png", "caption": f"a {name} picture"}) + "\n")
    run = run_engine(root, recipe, *SMALL, f"data.paths=[{folder / 'data.jsonl'}]", "data.eval_fraction=0.25",
                     "data.batch_size=8", "optim.lr=1e-2", "train.max_steps=40", "train.eval_every=40", "checkpoint.every=0")
    shutil.copytree(recipe, run / rd.SNAPSHOT_DIRNAME)
    return run, folder


def held_out_records(folder: Path) -> list[dict]:
    records = [json.loads(line) for line in (folder / "data.jsonl").read_text().splitlines()]
    return [r for i, r in enumerate(records, 1) if vlm.is_eval_document(f"data.jsonl:{i}", 0.25)]


def test_the_export_is_a_hugging_face_vlm_that_captions_held_out_images(workspace, captioned):
    from PIL import Image
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    root, _ = workspace
    run, folder = captioned
    logged = [untimed(r, derived_step_time=False) for r in run_metrics.read_all_metrics(run / rd.METRICS_JSONL)
              if "caption_accuracy" in r]
    assert logged == [{"step": 40, "caption_accuracy": 1.0}]  # logged at the evaluation
    model_io.export(run, 40, root / "exported")
    model = LlavaForConditionalGeneration.from_pretrained(root / "exported")
    processor = AutoProcessor.from_pretrained(root / "exported")
    held_out = held_out_records(folder)
    assert len(held_out) >= 8
    for record in held_out:
        with Image.open(folder / record["image"]) as image:
            inputs = processor(images=image, text="<image>", return_tensors="pt")
        output = model.generate(**inputs, max_new_tokens=20, do_sample=False)
        said = processor.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
        assert said == record["caption"]

    evaluated = model_io.evaluate(run, 40)
    assert evaluated.metrics == {"caption_accuracy": 1.0} and evaluated.eval_loss is not None
    assert evaluated.eval_loss < 0.5
    sampled = model_io.sample(run, 40, ["a", "a"]).samples
    assert [s.input for s in sampled] == [f"held-out image data.jsonl:{i}" for i in range(1, 61)
                                          if vlm.is_eval_document(f"data.jsonl:{i}", 0.25)][:2]
    assert all("a" + s.completion == s.expected and s.stopped == "eos" for s in sampled), sampled


def test_a_stage_two_run_starts_from_an_exported_run(workspace, captioned):
    root, recipe = workspace
    exported = root / "exported"
    if not exported.is_dir():
        model_io.export(captioned[0], 40, exported)
    run = run_engine(root, recipe, *SMALL, f"model.pretrained_path={exported}",
                     f"data.paths=[{captioned[1] / 'data.jsonl'}]", "data.batch_size=8", "train.max_steps=2",
                     "checkpoint.every=0", "checkpoint.at_end=false")
    first = losses(captioned[0])[1]
    assert losses(run)[1] < 0.1 * first  # it starts where the exported run ended
    with pytest.raises(ConfigError, match="set data.image_size=32 and model.patch_size=8"):
        vlm.load_processor(vlm.VLMConfig.model_validate(
            {"model": {"pretrained_path": str(exported)}, "data": {"image_size": 16}}))


def test_a_causal_lm_export_becomes_the_language_model(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    language = LlamaForCausalLM(LlamaConfig(vocab_size=258, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                                            tie_word_embeddings=False))
    language.save_pretrained(tmp_path / "lm")
    processor = vlm.build_processor(32, 8)
    cfg = vlm.ModelConfig(language_model_path=str(tmp_path / "lm"), stage="align")
    model = vlm.build_model(cfg, processor, seq_len=48)
    embeddings = model.get_input_embeddings().weight
    assert embeddings.shape == (259, 32)  # a row added for <image>
    torch.testing.assert_close(embeddings[:258], language.model.embed_tokens.weight, rtol=0, atol=0)
    torch.testing.assert_close(model.lm_head.weight[:258], language.lm_head.weight, rtol=0, atol=0)
    for name, value in language.model.layers.state_dict().items():
        torch.testing.assert_close(model.model.language_model.layers.state_dict()[name], value, rtol=0, atol=0)
    batch = vlm.collate(vlm.make_pieces(vlm.builtin_examples(2, 32), processor, 48), 48, 257)
    logits = model(input_ids=batch["input_ids"], pixel_values=batch["pixel_values"], use_cache=False).logits
    assert logits.shape == (2, batch["input_ids"].shape[1], 259)
    with pytest.raises(ConfigError, match="lower data.seq_len"):
        vlm.build_model(cfg, processor, seq_len=200)


def test_sample_shows_held_out_images_and_refuses_without_them():
    from engine.distributed import DistInfo

    def engine(eval_fraction):
        config = vlm.VLMConfig.model_validate({"data": {"builtin_images": 40, "eval_fraction": eval_fraction}})
        return vlm.VLM(config, DistInfo(0, 1, 0, torch.device("cpu"), None))

    shown = engine(0.25)
    held_out = shown.held_out
    inputs, about = shown.sample_inputs(len(held_out) + 1, "a red")  # prompts beyond the images wrap around
    (name, text), image = held_out.about(1), held_out.image(1)
    assert (name, image.shape) == ([n for n, _, _ in vlm.builtin_examples(40, 32) if vlm.is_eval_document(n, 0.25)][1],
                                   (32, 32, 3))
    assert about == {"input": f"held-out image {name}", "expected": text}
    assert inputs["input_ids"].tolist() == [[shown.processor.image_token_id] * 16 + list(b"a red")]
    torch.testing.assert_close(inputs["pixel_values"], vlm.pixel_values(shown.processor, [image]))
    with pytest.raises(ConfigError, match="no images are held out"):
        engine(0.0).sample_inputs(0, "a")
