"""vlm_chat runs on tiny random models of real families: launch → train → evaluate → sample (held-out
images and the user's own) → export → load with transformers, per family; and two processes
sharding Qwen2-VL's towers match one. The slow half of test_vlm_chat.py, in a file of its own so
that the suite's two workers share the runs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.templates.test_vlm_chat import LEARNT, TEMPLATE, vlm
from tests.vlm_families import available, each, tiny_vlm_folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm_families")
    return {family: tiny_vlm_folder(root / family, family) for family in available(tuple(FORMS))}

# ---------------------------------------------------------------------------------------------
# launch → train → evaluate → sample → export → load with transformers, per family
# ---------------------------------------------------------------------------------------------

RUN = ("train.max_steps=150", "train.log_every=10", "train.eval_every=150", "checkpoint.every=0",
       "data.eval_fraction=0.15", "data.eval_prompts=40", "metrics.tensorboard=false")
# Each family learns from another form of the same colour questions (images as files or bytes).
FORMS = {"llava": "llava.json", "qwen2_vl": "messages.jsonl", "idefics3": "messages.parquet", "qwen3_vl": "llava.json"}


def colour_data(folder: Path, form: str, count: int = 300) -> list[tuple[str, str]]:
    """The built-in colour questions as image files and records of ``form``; ``(where, answer)``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    (folder / "images").mkdir(parents=True)
    records, answers = [], []
    for i, (_, messages, (image,)) in enumerate(vlm.builtin_examples(count, 56)):
        answer = messages[1]["content"][0]["text"]
        image.save(folder / "images" / f"{i}.png")
        if form == "llava.json":
            records.append({"image": f"images/{i}.png", "conversations": [
                {"from": "human", "value": f"<image>\n{vlm.QUESTION}"}, {"from": "gpt", "value": answer}]})
        else:
            records.append({"images": [{"bytes": (folder / "images" / f"{i}.png").read_bytes(), "path": None}],
                            "messages": [{"role": "user", "content": [{"type": "image", "text": None},
                                                                      {"type": "text", "text": vlm.QUESTION}]},
                                         {"role": "assistant", "content": [{"type": "text", "text": answer}]}]})
        answers.append((f"{form}:{i + 1}", answer))
    if form == "llava.json":
        (folder / form).write_text(json.dumps(records))
    elif form == "messages.parquet":
        pq.write_table(pa.Table.from_pylist(records), folder / form)
    else:
        for record in records:
            record["messages"][0]["content"][0] = {"type": "image", "image": record["images"][0]["path"] or ""}
        lines = [{"messages": [{"role": "user", "content": [{"type": "image", "image": f"images/{i}.png"},
                                                            {"type": "text", "text": vlm.QUESTION}]},
                               {"role": "assistant", "content": answer}]} for i, (_, answer) in enumerate(answers)]
        (folder / form).write_text("".join(json.dumps(line) + "\n" for line in lines))
    return answers


@pytest.mark.slow
@pytest.mark.parametrize("family", each(tuple(FORMS)))
def test_a_run_learns_held_out_colour_questions_that_its_export_answers_in_its_chat_format(family, folders, tmp_path):
    from engine import model_io
    from engine import run_dir as rd
    from engine import run_metrics
    from tests.support import run_engine

    recipe = tmp_path / "vlm_chat"
    shutil.copytree(TEMPLATE, recipe, ignore=shutil.ignore_patterns("__pycache__"))
    model = shutil.copytree(folders[family], tmp_path / "model")
    form = FORMS[family]
    answers = colour_data(tmp_path / "data", form)
    run = run_engine(tmp_path, recipe, f"model.pretrained_path={model}", f"data.paths=[{tmp_path}/data/{form}]", *RUN)
    shutil.copytree(recipe, run / rd.SNAPSHOT_DIRNAME)

    summary = rd.read_run(run).data
    processor = vlm.load_processor(str(model))
    independent = sum(len(processor.tokenizer(LEARNT[family].format(a), add_special_tokens=False)["input_ids"])
                      for _, a in answers)
    assert summary.loss_tokens == independent and summary.documents == 300
    assert summary.format == f"{'llava' if form.startswith('llava') else 'messages'} (300 images)"
    held_out = [(w, a) for w, a in answers if vlm.is_eval_document(w, 0.15)]
    logged = [r for r in run_metrics.read_all_metrics(run / rd.METRICS_JSONL) if "answer_accuracy" in r]
    assert logged[-1]["answer_accuracy"] >= 0.9 and logged[-1]["answered"] == min(40, len(held_out))  # chance: 0.25

    evaluated = model_io.evaluate(run, 150)
    assert evaluated.metrics["answer_accuracy"] >= 0.9 and evaluated.loss_tokens == summary.eval_loss_tokens
    sampled = model_io.sample(run, 150, [vlm.QUESTION, vlm.QUESTION], max_new_tokens=8)
    assert sampled.chat
    sampled = sampled.samples
    assert [s.expected for s in sampled] == [a for _, a in held_out[:2]]
    assert all(vlm.same_answer(s.completion, s.expected) for s in sampled), sampled
    # The user's own images, one per prompt: each is answered about its own colour.
    asked = held_out[:4]
    images = [str(tmp_path / "data" / "images" / f"{int(w.rsplit(':', 1)[1]) - 1}.png") for w, _ in asked]
    mine = model_io.sample(run, 150, [vlm.QUESTION] * len(asked), max_new_tokens=8, images=images).samples
    assert [s.input for s in mine] == [f"image {path}" for path in images] and all(s.expected is None for s in mine)
    assert all(vlm.same_answer(s.completion, a) for s, (_, a) in zip(mine, asked)), mine

    from transformers import AutoModelForImageTextToText, AutoProcessor

    model_io.export(run, 150, tmp_path / "exported")
    exported = AutoModelForImageTextToText.from_pretrained(tmp_path / "exported")
    if family in ("qwen2_vl", "qwen3_vl") and not vlm.torchvision_available():
        loaded = vlm.load_processor(str(tmp_path / "exported"))  # AutoProcessor builds a video processor
    else:
        loaded = AutoProcessor.from_pretrained(tmp_path / "exported")
    from PIL import Image

    right = 0
    for where, answer in held_out:
        index = int(where.rsplit(":", 1)[1]) - 1
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": vlm.QUESTION}]}]
        text = loaded.apply_chat_template(messages, add_generation_prompt=True)
        with Image.open(tmp_path / "data" / "images" / f"{index}.png") as image:
            inputs = loaded(text=[text], images=[[image.convert("RGB")]], return_tensors="pt")
        output = exported.generate(**inputs, max_new_tokens=8, do_sample=False)
        right += vlm.same_answer(loaded.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True), answer)
    assert right / len(held_out) >= 0.9


@pytest.mark.multiprocess
@pytest.mark.slow
def test_two_processes_shard_qwen2_vl_by_its_own_blocks_and_match_one(folders, tmp_path):
    """FSDP2 over both towers' blocks (the model's _no_split_modules), Qwen's 3-D positions per
    rank's batch: the losses of 2 processes are those of 1."""
    from tests.support import losses, run_engine

    recipe = shutil.copytree(TEMPLATE, tmp_path / "vlm_chat", ignore=shutil.ignore_patterns("__pycache__"))
    schedule = (f"model.pretrained_path={folders['qwen2_vl']}", "train.max_steps=6", "train.log_every=1",
                "train.eval_every=0", "checkpoint.every=0", "checkpoint.at_end=false", "data.builtin_images=100",
                "data.batch_size=8", "metrics.tensorboard=false")
    one, two = (losses(run_engine(tmp_path, recipe, *schedule, nproc=n)) for n in (1, 2))
    assert sorted(one) == sorted(two) == list(range(1, 7))
    for step in one:
        assert abs(two[step] - one[step]) <= 1e-4 * abs(one[step]), (step, one[step], two[step])


