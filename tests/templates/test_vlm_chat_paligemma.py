"""PaliGemma through the vlm_chat template: no chat by design, the user's text is the processor's
prefix and the answer its ``suffix``. A tiny random PaliGemma (SigLIP tower + Gemma, built
offline) trains on LLaVA conversations with the loss on the suffix's tokens only, ``sample``
answers from the prefix, and its export loads with ``AutoModelForImageTextToText`` and
``AutoProcessor`` and answers the same; conversations of more turns are refused naming why."""

from __future__ import annotations

import shutil

import pytest

from engine.config import ConfigError
from engine.engine import IGNORE_INDEX
from tests.templates.test_vlm_chat import TEMPLATE, vlm
from tests.templates.test_vlm_chat_runs import colour_data
from tests.vlm_families import tiny_vlm_folder

STEPS = 120


@pytest.fixture(scope="module")
def paligemma(tmp_path_factory):
    return tiny_vlm_folder(tmp_path_factory.mktemp("paligemma") / "model", "paligemma")


@pytest.fixture(scope="module")
def trained(paligemma, tmp_path_factory):
    from engine import run_dir as rd
    from tests.support import run_engine

    root = tmp_path_factory.mktemp("paligemma_run")
    recipe = root / "vlm_chat"
    shutil.copytree(TEMPLATE, recipe, ignore=shutil.ignore_patterns("__pycache__"))
    answers = colour_data(root / "data", "llava.json", count=40)
    run = run_engine(root, recipe, f"model.pretrained_path={paligemma}", f"data.paths=[{root}/data/llava.json]",
                     f"train.max_steps={STEPS}", "train.log_every=5", "train.eval_every=0", "checkpoint.every=0",
                     "data.eval_fraction=0.2", "data.batch_size=8", "metrics.tensorboard=false")
    shutil.copytree(recipe, run / rd.SNAPSHOT_DIRNAME)
    return root, run, answers


def picture(colour=(200, 30, 30)):
    from PIL import Image

    return Image.new("RGB", (40, 40), colour)


def test_the_suffix_alone_is_learnt_and_more_turns_are_refused(paligemma):
    processor = vlm.load_processor(str(paligemma))
    assert vlm.prefix_suffix(processor)
    messages = [vlm.user_turn([vlm.QUESTION], 1), vlm.assistant_turn("dark red")]
    piece = vlm.encode(processor, messages, [picture()], 512, "a record")
    tokenizer = processor.tokenizer
    learnt = piece["targets"][piece["targets"] != IGNORE_INDEX].tolist()
    assert learnt == tokenizer("dark red", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert vlm.loss_tokens(piece) == len(learnt)
    image_id = processor.image_token_id
    assert (piece["ids"] == image_id).sum() == 16 and (piece["ids"][:16] == image_id).all()
    assert piece["per_token"]["token_type_ids"].tolist() == (piece["targets"] != IGNORE_INDEX).long().tolist()
    longer = messages + [vlm.user_turn(["And now?"]), vlm.assistant_turn("blue")]
    with pytest.raises(ConfigError, match=r"^a record: turns user, assistant, user, assistant; this model "
                                          r"\(prefix/suffix, no chat template, as PaliGemma\) takes one user turn"):
        vlm.encode(processor, longer, [picture()], 512, "a record")
    with pytest.raises(ConfigError, match=r"^a record: no image; this model \(prefix/suffix, as PaliGemma\)"):
        vlm.encode(processor, [vlm.user_turn([vlm.QUESTION]), vlm.assistant_turn("red")], [], 512, "a record")
    with pytest.raises(ConfigError, match=r"^a record: the images' tokens end at token 16, beyond data.seq_len=8"):
        vlm.encode(processor, messages, [picture()], 8, "a record")


def test_a_run_learns_the_suffix_and_its_export_answers_as_sample_does(paligemma, trained, tmp_path):
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from engine import model_io
    from engine import run_dir as rd
    from engine import run_metrics

    root, run, answers = trained
    summary = rd.read_run(run).data
    tokenizer = vlm.load_processor(str(paligemma)).tokenizer
    # The suffix's tokens and its end, counted by the tokenizer alone.
    independent = sum(len(tokenizer(a, add_special_tokens=False)["input_ids"]) + 1 for _, a in answers)
    assert summary.loss_tokens == independent and summary.format == "llava (40 images)"
    assert summary.mask == "completion"
    losses = [r["loss"] for r in run_metrics.read_all_metrics(run / rd.METRICS_JSONL) if "loss" in r]
    assert losses[-1] < losses[0] - 2, losses  # from about ln(vocabulary): the suffix is being learnt

    held_out = [(w, a) for w, a in answers if vlm.is_eval_document(w, 0.2)]
    evaluated = model_io.evaluate(run, STEPS)  # task_metrics() asks each held-out prefix
    assert evaluated.loss_tokens == summary.eval_loss_tokens and evaluated.metrics["answered"] == len(held_out)
    sampled = model_io.sample(run, STEPS, [vlm.QUESTION, vlm.QUESTION], max_new_tokens=4)
    assert not sampled.chat and [s.expected for s in sampled.samples] == [a for _, a in held_out[:2]]
    images = [root / "data" / "images" / f"{int(w.rsplit(':', 1)[1]) - 1}.png" for w, _ in held_out[:2]]
    mine = model_io.sample(run, STEPS, [vlm.QUESTION] * 2, max_new_tokens=4, images=[str(i) for i in images]).samples

    model_io.export(run, STEPS, tmp_path / "exported")
    exported = AutoModelForImageTextToText.from_pretrained(tmp_path / "exported")
    loaded = AutoProcessor.from_pretrained(tmp_path / "exported")
    assert type(exported).__name__ == "PaliGemmaForConditionalGeneration" and loaded.chat_template is None
    # Answered from the prefix in the suffix's form: a colour's name (which one is beyond these few steps).
    assert all(s.completion in vlm.COLOURS for s in sampled.samples + mine), sampled.samples + mine
    for path, sample in zip(images, mine):
        with Image.open(path) as image:
            inputs = loaded(text=[f"<image>{vlm.QUESTION}"], images=[[image.convert("RGB")]], return_tensors="pt")
        output = exported.generate(**inputs, max_new_tokens=4, do_sample=False)
        assert loaded.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True) == sample.completion


def test_a_transformers_without_the_family_processor_is_refused_naming_family_class_and_what(paligemma, monkeypatch):
    import transformers

    # An older transformers: its lazy module has no such name to load.
    lazy = type(transformers).__getattr__

    def without(module, name):
        if name == "PaliGemmaProcessor":
            raise AttributeError(name)
        return lazy(module, name)

    monkeypatch.delattr(transformers, "PaliGemmaProcessor", raising=False)
    monkeypatch.setattr(type(transformers), "__getattr__", without)
    with pytest.raises(ConfigError, match=rf"^model.pretrained_path={paligemma} \(paligemma\) needs the processor "
                                          rf"PaliGemmaProcessor, which transformers {transformers.__version__} does "
                                          "not have; upgrade transformers$"):
        vlm.load_processor(str(paligemma))


def test_text_that_spells_the_image_token_is_refused_naming_the_record(paligemma):
    # "<image>" in a PaliGemma record's text is its image token: the processor counted it as an
    # image and failed with its own ValueError, naming no record (the launch check's traceback).
    processor = vlm.load_processor(str(paligemma))
    for messages in ([vlm.user_turn([vlm.QUESTION], 1), vlm.assistant_turn("red <image> red")],
                     [vlm.user_turn(["look <image> here"], 1), vlm.assistant_turn("red")]):
        with pytest.raises(ConfigError, match=r"^data.jsonl:7: a text holds '<image>', which this model's processor "
                                              r"reads as an image token"):
            vlm.encode(processor, messages, [picture()], 512, "data.jsonl:7")


# Skills on PaliGemma (SigLIP's model.vision_tower, model.multi_modal_projector, Gemma's
# model.language_model with lm_head): each applied to the template, two steps trained in this process.
SKILLED = {"freeze+checkpointing": [("freeze", {"parts": ["vision_tower", "projector"]}), ("gradient-checkpointing", {})],
           "lora": [("lora", {})]}


@pytest.fixture(scope="module")
def skilled(paligemma, tmp_path_factory) -> dict:
    from engine import model_io
    from skills import apply_skill
    from tests.templates.test_vlm_chat_lora import train_here

    out = {}
    for name, skills in SKILLED.items():
        root = tmp_path_factory.mktemp(name.replace("+", "_"))
        recipe = shutil.copytree(TEMPLATE, root / "vlm_chat", ignore=shutil.ignore_patterns("__pycache__"))
        applied = [apply_skill(skill, recipe, params) for skill, params in skills]
        colour_data(root / "data", "llava.json", count=8)
        run, printed = train_here(root, recipe, f"model.pretrained_path={paligemma}", f"data.paths=[{root}/data/llava.json]",
                                  "train.max_steps=2", "train.log_every=1", "train.eval_every=0", "checkpoint.every=0",
                                  "checkpoint.at_end=true", "data.eval_fraction=0", "data.batch_size=4",
                                  "metrics.tensorboard=false")
        from engine import run_dir as rd

        shutil.copytree(recipe, run / rd.SNAPSHOT_DIRNAME)
        out[name] = {"applied": applied, "printed": printed, "model": model_io.load_engine(run, 2).model}
    return out


def trainable_parts(model) -> set[str]:
    """Which of model.vision_tower, model.multi_modal_projector, model.language_model, lm_head have a trainable parameter."""
    return {n.split(".")[0] if n.startswith("lm_head") else ".".join(n.split(".")[:2])
            for n, p in model.named_parameters() if p.requires_grad}


def test_freeze_and_checkpointing_act_on_paligemmas_parts_and_a_step_runs(skilled):
    done = skilled["freeze+checkpointing"]
    assert [a.changed for a in done["applied"]] == [True, True]
    # Gemma ties lm_head to the embeddings: the language model alone trains.
    assert trainable_parts(done["model"]) == {"model.language_model"}
    assert "freeze: froze 1,056 of 100,224 parameter values" in done["printed"]  # the projector (the tower was frozen)
    assert "step 2/2 | loss" in done["printed"]
    # The model's own switch, on in both towers and their layers.
    switched = sorted(n for n, m in done["model"].named_modules() if getattr(m, "gradient_checkpointing", False) is True)
    assert switched == ["model.language_model", "model.language_model.layers.0", "model.language_model.layers.1",
                        "model.vision_tower.encoder", "model.vision_tower.encoder.layers.0",
                        "model.vision_tower.encoder.layers.1"]


def test_lora_adapts_paligemmas_language_model_alone(skilled):
    done = skilled["lora"]
    assert "within=language_model" in done["applied"][0].diff
    adapted = [n for n, m in done["model"].named_modules() if hasattr(m, "lora_A")]
    # Gemma's 7 linear layers in each of its 2 decoder layers; none of SigLIP's.
    assert len(adapted) == 14 and all(n.startswith("model.language_model.layers.") for n in adapted), adapted
    assert all(".lora_" in n for n, p in done["model"].named_parameters() if p.requires_grad)


@pytest.mark.parametrize("stage, parts", [("align", {"model.multi_modal_projector"}),
                                          ("finetune", {"model.multi_modal_projector", "model.language_model"})])
def test_the_vlm_freeze_policy_stages_train_paligemmas_parts_and_a_step_runs(paligemma, stage, parts):
    """vlm_chat has its own stage policy (model.train_*), so the skill's helper is run here on the
    model as the skill writes it into a recipe that has none."""
    import torch

    from engine import vision_language
    from skills.registry import skill

    helper = {"torch": torch, **vars(vision_language)}
    exec(skill("vlm-freeze-policy").codemod.HELPER, helper)
    model = vlm.load_model(vlm.ModelConfig(pretrained_path=str(paligemma)))
    helper["apply_vlm_stage"](model, stage)
    assert trainable_parts(model) == parts
    processor = vlm.load_processor(str(paligemma))
    piece = vlm.encode(processor, [vlm.user_turn([vlm.QUESTION], 1), vlm.assistant_turn("red")], [picture()], 512, "row")
    batch = vlm.collate([piece], processor)
    loss = model(**{k: v for k, v in batch.items() if k != "labels"}).logits.float().square().mean()
    loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
