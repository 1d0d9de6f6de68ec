"""Video in the vlm_chat template (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): a folder of frames or a video file,
sampled as the family's video processor samples, made into ``pixel_values_videos`` and
``video_grid_thw`` on the family's image processing where transformers' video processors cannot
load (no torchvision here); the data forms, the refusals naming the record, the data summary, and a
run that learns which way a square moves."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.config import ConfigError
from engine.data_files import WORKSPACE_VARIABLE, DataPathRefused
from tests.templates.test_vlm_chat import TEMPLATE, vlm
from tests.vlm_families import tiny_vlm_folder

VIDEO_FAMILIES = ("qwen2_vl", "qwen2_5_vl")
QUESTION = "Which way does the square move?"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm_video_families")
    return {family: tiny_vlm_folder(root / family, family) for family in (*VIDEO_FAMILIES, "qwen3_vl", "llava")}


def noise(seed: int, size=(70, 90)) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (*size, 3)).astype(np.uint8)


def save_frames(folder: Path, frames: list[np.ndarray], names: list[str] | None = None) -> Path:
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    for frame, name in zip(frames, names or [f"frame_{i}.png" for i in range(len(frames))]):
        Image.fromarray(frame).save(folder / name)
    return folder


def video_turns(question: str = QUESTION, answer: str = "left") -> list:
    return [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": question}]},
            vlm.assistant_turn(answer)]


def video_inputs(processor, video) -> dict:
    text = processor.apply_chat_template(video_turns(), tokenize=False)
    return vlm.processor_inputs(processor, text, [video], "a record")


def image_patches(processor, frame: np.ndarray) -> dict:
    from PIL import Image

    return processor.image_processor(images=[Image.fromarray(frame)], return_tensors="pt")


@pytest.mark.parametrize("family", [*VIDEO_FAMILIES, "qwen3_vl"])
def test_a_video_of_identical_frames_is_the_image_processors_patches_of_that_frame(family, folders, tmp_path):
    """Qwen's image processing repeats an image's frame to fill a temporal patch: a video of
    temporal_patch_size copies of that frame has the very same patch values, grid and tokens."""
    processor = vlm.load_processor(str(folders[family]))
    frame = noise(0)
    video = vlm.VideoRef.checked("clip", save_frames(tmp_path / "clip", [frame, frame]).parent, "a record", 2.0, 16)
    out = video_inputs(processor, video)
    image = image_patches(processor, frame)
    assert torch.equal(out["pixel_values_videos"], image["pixel_values"])
    # 70 × 90 pixels within 4 merged units (of 28 pixels, Qwen3-VL's of 32): 1 × 2 units, 2 tokens.
    assert out["video_grid_thw"].tolist() == image["image_grid_thw"].tolist() == [[1, 2, 4]]
    video_pad = processor.tokenizer.convert_tokens_to_ids("<|video_pad|>")
    assert int((out["input_ids"] == video_pad).sum()) == 2


def test_frames_take_the_model_folders_video_settings_else_transformers_defaults(folders, tmp_path):
    """A model folder's saved video processor settings bound a frame's pixels (here 28 × 28 at
    most: 1 merged unit, where the image processor allows 4); a folder that saves none gets
    Qwen2VLVideoProcessor's bounds (at least 128 units: a 56 × 56 frame grows to 336 × 336)."""
    video = vlm.VideoRef.checked("clip", save_frames(tmp_path / "clip", [noise(0, (56, 56))] * 2).parent,
                                 "a record", 2.0, 16)
    for saved, grid in (({"size": {"shortest_edge": 28 * 28, "longest_edge": 28 * 28}}, [1, 2, 2]), (None, [1, 24, 24])):
        model = shutil.copytree(folders["qwen2_vl"], tmp_path / f"model-{grid[1]}")
        config = json.loads((model / "processor_config.json").read_text())
        config.pop("video_processor") if saved is None else config["video_processor"].update(saved)
        (model / "processor_config.json").write_text(json.dumps(config))
        processor = vlm.load_processor(str(model))
        assert video_inputs(processor, video)["video_grid_thw"].tolist() == [grid]
        assert vlm.processor_inputs(processor, "<|vision_start|><|image_pad|><|vision_end|>",
                                    [vlm.image_of(vlm.read_image(str(tmp_path / "clip" / "frame_0.png"), None, "x"))]
                                    )["image_grid_thw"].tolist() == [[1, 4, 4]]


def test_frames_in_name_order_sampled_evenly_each_fill_their_own_temporal_slot(folders, tmp_path):
    """Ten frames named frame_0..frame_9 (frame_10 would sort after frame_9), at most four: frames
    0, 2, 5 and 7, as transformers' sample_frames spreads them; two temporal patches of two frames,
    each frame's patches in its own slot of the (channel, time, height, width) patch."""
    processor = vlm.load_processor(str(folders["qwen2_vl"]))
    frames = [noise(i, (56, 56)) for i in range(10)]
    save_frames(tmp_path / "clip", frames, [f"frame_{i}.png" for i in range(10)])
    video = vlm.VideoRef.checked("clip", tmp_path, "a record", 2.0, 4)
    out = video_inputs(processor, video)
    assert out["video_grid_thw"].tolist() == [[2, 4, 4]]
    patches = out["pixel_values_videos"].reshape(2, 16, 3, 2, 14, 14)  # (time, patches, channel, slot, 14, 14)
    for (group, slot), index in zip([(0, 0), (0, 1), (1, 0), (1, 1)], [0, 2, 5, 7]):
        alone = image_patches(processor, frames[index])["pixel_values"].reshape(16, 3, 2, 14, 14)[:, :, 0]
        assert torch.equal(patches[group, :, :, slot], alone), (group, slot, index)


def test_a_short_video_repeats_its_last_frame_to_fill_a_temporal_patch(folders, tmp_path):
    processor = vlm.load_processor(str(folders["qwen2_vl"]))
    frames = [noise(i, (56, 56)) for i in range(3)]
    out = video_inputs(processor, vlm.VideoRef.checked("clip", save_frames(tmp_path / "clip", frames).parent,
                                                       "a record", 2.0, 16))
    # Three frames: a multiple of two is two, spread as sample_frames spreads them (frames 0 and 1).
    assert out["video_grid_thw"].tolist() == [[1, 4, 4]]
    one = vlm.VideoRef.checked("one", save_frames(tmp_path / "one", frames[:1]).parent, "a record", 2.0, 16)
    assert torch.equal(video_inputs(processor, one)["pixel_values_videos"],
                       image_patches(processor, frames[0])["pixel_values"])


def write_video(path: Path, frames: list[np.ndarray], rate: int, codec: str = "ffv1") -> Path:
    """A lossless FFV1 video in Matroska (its stream counts no frames: they are counted by decoding):
    the frames decode back bit for bit; or MPEG-4 in MP4, whose stream counts them."""
    av = pytest.importorskip("av", reason="PyAV (pip install av) decodes video files")
    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=rate)
        pixels = "bgr0" if codec == "ffv1" else "yuv420p"
        stream.width, stream.height, stream.pix_fmt = frames[0].shape[1], frames[0].shape[0], pixels
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    return path


def test_a_video_file_is_decoded_and_sampled_at_data_video_fps(folders, tmp_path):
    """20 frames at 10 a second are 2 seconds: at 2 frames a second, 4 frames, 0, 5, 10 and 15."""
    frames = [noise(i, (42, 56)) for i in range(20)]
    write_video(tmp_path / "clip.mkv", frames, rate=10)
    video = vlm.VideoRef.checked("clip.mkv", tmp_path, "a record", 2.0, 16)
    decoded, metadata = video.open(2)
    assert [np.asarray(f).tolist() for f in decoded] == [frames[i].tolist() for i in (0, 5, 10, 15)]
    assert metadata.frames_indices == [0, 5, 10, 15] and metadata.sampled_fps == 2.0
    fewer = vlm.VideoRef.checked("clip.mkv", tmp_path, "a record", 2.0, 2).open(2)[1]
    assert fewer.frames_indices == [0, 10]
    processor = vlm.load_processor(str(folders["qwen2_vl"]))
    assert video_inputs(processor, video)["video_grid_thw"].tolist() == [[2, 4, 4]]  # 42 × 56 resized to 56 × 56
    # MPEG-4 is lossy: each decoded frame is nearest its own of the 20 (flat colours, one a frame).
    flat = [np.full((48, 64, 3), (12 * i, 255 - 12 * i, (90 * i) % 256), dtype=np.uint8) for i in range(20)]
    write_video(tmp_path / "clip.mp4", flat, rate=10, codec="mpeg4")
    decoded, metadata = vlm.VideoRef.checked("clip.mp4", tmp_path, "a record", 2.0, 16).open(2)
    assert metadata.total_num_frames == 20 and metadata.frames_indices == [0, 5, 10, 15]
    nearest = [int(np.argmin([np.abs(np.asarray(f, float) - g).mean() for g in flat])) for f in decoded]
    assert nearest == [0, 5, 10, 15]


@pytest.fixture
def workspace(tmp_path, monkeypatch):
    monkeypatch.setenv(WORKSPACE_VARIABLE, str(tmp_path))
    data = tmp_path / "data"
    save_frames(data / "videos" / "clip", [noise(0, (56, 56)), noise(1, (56, 56))])
    (data / "videos" / "empty").mkdir()
    (data / "videos" / "broken.mp4").write_bytes(b"not a video at all")
    save_frames(tmp_path.parent / f"{tmp_path.name}-outside", [noise(0, (56, 56))])
    return data


def messages_record(video: str) -> dict:
    return {"messages": [{"role": "user", "content": [{"type": "video", "video": video},
                                                      {"type": "text", "text": QUESTION}]},
                         {"role": "assistant", "content": "left"}]}


BAD = [
    (messages_record("videos/none"), ConfigError,
     r"bad.jsonl:1: video 'videos/none' does not exist \(a path relative to the data file\)"),
    (messages_record("videos/empty"), ConfigError,
     r"bad.jsonl:1: video 'videos/empty' is a folder with no frames \(.png, .jpg"),
    (messages_record("videos/broken.mp4"), ConfigError, r"bad.jsonl:1: video 'videos/broken.mp4' cannot be read as a video"),
    (messages_record("videos/../../../OUTSIDE"), DataPathRefused, "leads outside the workspace"),
    ({"video": "videos/clip", "conversations": [{"from": "human", "value": QUESTION}, {"from": "gpt", "value": "left"}]},
     ConfigError, r"bad.jsonl:1: 0 <video> placeholder\(s\) for 1 video\(s\); put one <video> in the conversation"),
    ({"video": "videos/clip", "conversations": [{"from": "human", "value": "<video>"}, {"from": "gpt", "value": "<video>"}]},
     ConfigError, r"bad.jsonl:1: turn 2 \(the assistant's\) holds <video>; images and videos go in user turns"),
]


@pytest.mark.parametrize("record, error, message", BAD)
def test_bad_videos_are_refused_naming_the_file_and_line(workspace, record, error, message):
    if "broken" in json.dumps(record):
        pytest.importorskip("av", reason="PyAV (pip install av) decodes video files")
    outside = f"{workspace.parent.name}-outside"  # a folder of frames beside the workspace
    (workspace / "bad.jsonl").write_text(json.dumps(record).replace("OUTSIDE", outside) + "\n")
    before = sorted(p.relative_to(workspace) for p in workspace.rglob("*"))
    with pytest.raises(error, match=message):
        vlm.load_examples(vlm.VLMChatDataConfig(paths=[str(workspace / "bad.jsonl")]))
    assert sorted(p.relative_to(workspace) for p in workspace.rglob("*")) == before


def test_a_family_that_takes_images_only_is_refused_naming_the_record(folders, tmp_path):
    video = vlm.VideoRef.checked("clip", save_frames(tmp_path / "clip", [noise(0)] * 2).parent, "a record", 2.0, 16)
    processor = vlm.load_processor(str(folders["llava"]))
    with pytest.raises(ConfigError, match=r"^bad.jsonl:3: a video, and the family Llava takes images only; give the "
                                          r"video's frames as images or a family that takes video \(Qwen2-VL, Qwen2.5-VL, Qwen3-VL\)"):
        vlm.encode(processor, video_turns(), [video], 512, "bad.jsonl:3")


def test_frames_beyond_the_sequence_length_are_refused_naming_the_record(folders, tmp_path):
    processor = vlm.load_processor(str(folders["qwen2_vl"]))
    frames = [noise(i, (56, 56)) for i in range(16)]
    video = vlm.VideoRef.checked("clip", save_frames(tmp_path / "clip", frames).parent, "bad.jsonl:2", 2.0, 16)
    # 16 frames: 8 temporal patches of 2 × 2 merged units, 4 tokens each.
    with pytest.raises(ConfigError, match=r"^bad.jsonl:2: the images and videos take 32 tokens \(the videos 16 frames\), "
                                          r"more than data.seq_len=24; raise data.seq_len, lower data.video_max_frames"):
        vlm.encode(processor, video_turns(), [video], 24, "bad.jsonl:2")
    assert len(vlm.encode(processor, video_turns(), [video], 64, "bad.jsonl:2")["ids"]) <= 65


def test_the_data_summary_counts_videos_and_frames_in_both_forms(folders, workspace):
    model = shutil.copytree(folders["qwen2_vl"], workspace.parent / "model")
    llava = {"video": "videos/clip", "conversations": [{"from": "human", "value": f"<video>\n{QUESTION}"},
                                                        {"from": "gpt", "value": "right"}]}
    lines = [messages_record("videos/clip"), messages_record("videos/clip"), llava]
    (workspace / "videos.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    save_frames(workspace / "images", [noise(3, (56, 56))], ["red.png"])
    (workspace / "image.json").write_text(json.dumps([{"image": "images/red.png", "conversations": [
        {"from": "human", "value": "<image>\nWhat colour?"}, {"from": "gpt", "value": "red"}]}]))
    examples, formats = vlm.load_examples(vlm.VLMChatDataConfig(paths=[str(workspace / "videos.jsonl")]))
    assert formats == ["messages", "llava"]
    assert examples[2][1][0]["content"] == [{"type": "video"}, {"type": "text", "text": QUESTION}]
    assert [type(media).__name__ for _, _, (media,) in examples] == ["VideoRef"] * 3
    config = vlm.VLMChatConfig.model_validate({"model": {"pretrained_path": str(model)}, "data": {
        "paths": [str(workspace / "videos.jsonl"), str(workspace / "image.json")], "eval_fraction": 0}})
    summary = vlm.VLMChat.summarize_data(config)
    assert summary.format == "messages, llava (1 images, 3 videos of 6 frames)" and summary.documents == 4


def motion_data(folder: Path, count: int) -> list[tuple[str, str]]:
    """Videos of four 56 × 56 frames in which a square moves left or right by 10 pixels a frame,
    from a random place: no one frame tells which way; ``(where, answer)`` of each record."""
    lines, answers = [], []
    for i in range(count):
        rng = np.random.default_rng([7, i])
        direction = ["left", "right"][rng.integers(2)]
        x, y, colour = rng.integers(0, 56 - 24 - 30 + 1), rng.integers(0, 56 - 24 + 1), rng.integers(120, 256, 3)
        frames = []
        for f in range(4):
            frame = rng.integers(0, 40, (56, 56, 3)).astype(np.uint8)
            at = x + 10 * (f if direction == "right" else 3 - f)
            frame[y:y + 24, at:at + 24] = colour
            frames.append(frame)
        save_frames(folder / "videos" / str(i), frames)
        lines.append({"messages": [{"role": "user", "content": [{"type": "video", "video": f"videos/{i}"},
                                                                {"type": "text", "text": QUESTION}]},
                                   {"role": "assistant", "content": direction}]})
        answers.append((f"motion.jsonl:{i + 1}", direction))
    (folder / "motion.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return answers


@pytest.mark.slow
@pytest.mark.parametrize("family", VIDEO_FAMILIES)
def test_a_run_learns_which_way_a_square_moves_in_held_out_videos(family, folders, tmp_path):
    """Through the recipe (launch, train, evaluate, sample): about 30 s a family on one thread."""
    from engine import model_io
    from engine import run_dir as rd
    from engine import run_metrics
    from tests.support import run_engine

    recipe = shutil.copytree(TEMPLATE, tmp_path / "vlm_chat", ignore=shutil.ignore_patterns("__pycache__"))
    model = shutil.copytree(folders[family], tmp_path / "model")
    answers = motion_data(tmp_path / "data", 300)
    run = run_engine(tmp_path, recipe, f"model.pretrained_path={model}", f"data.paths=[{tmp_path}/data/motion.jsonl]",
                     "model.train_vision_tower=true", "train.max_steps=150", "train.log_every=10", "train.eval_every=150",
                     "checkpoint.every=0", "data.eval_fraction=0.15", "data.eval_prompts=40", "metrics.tensorboard=false")
    shutil.copytree(recipe, run / rd.SNAPSHOT_DIRNAME)  # sample loads the run's recipe (a server records it)
    assert rd.read_run(run).data.format == "messages (0 images, 300 videos of 1200 frames)"
    held_out = [(w, a) for w, a in answers if vlm.is_eval_document(w, 0.15)]
    logged = [r for r in run_metrics.read_all_metrics(run / rd.METRICS_JSONL) if "answer_accuracy" in r]
    assert logged[-1]["answer_accuracy"] >= 0.9 and logged[-1]["answered"] == min(40, len(held_out))  # chance: 0.5
    sampled = model_io.sample(run, 150, [QUESTION, QUESTION], max_new_tokens=8).samples
    assert [s.expected for s in sampled] == [a for _, a in held_out[:2]]
    assert [s.input for s in sampled] == [f"held-out video(s) of {w}" for w, _ in held_out[:2]]
    assert all(vlm.same_answer(s.completion, s.expected) for s in sampled), sampled


@pytest.mark.parametrize("family", VIDEO_FAMILIES)
def test_packed_rows_of_videos_and_images_give_the_loss_they_have_padded(family, folders, tmp_path):
    """Videos of 2 and 4 frames beside images, one per padded row or packed (Qwen's 3-D positions per
    example, a video's in time too): the same loss."""
    from types import SimpleNamespace

    processor = vlm.load_processor(str(folders[family]))
    model = vlm.load_model(vlm.ModelConfig(pretrained_path=str(folders[family])))
    rope_index = vlm.rope_index_of(model)
    videos = [vlm.VideoRef.checked(str(n), save_frames(tmp_path / str(n), [noise(i, (56, 56)) for i in range(n)]).parent,
                                   f"video {n}", 2.0, 16) for n in (2, 4, 4)]
    examples = [(f"video {i}", video_turns(answer=a), [v]) for i, (v, a) in enumerate(zip(videos, ["left", "right", "up"]))]
    examples += vlm.builtin_examples(3, 56)
    pieces = [vlm.with_positions(vlm.encode(processor, m, i, 512, w), rope_index) for w, m, i in examples]
    inputs = [len(p["ids"]) - 1 for p in pieces]
    rows = vlm.pack(inputs, 2 * max(inputs))
    assert len(rows) < len(pieces)
    packed = vlm.collate_packed([[pieces[i] for i in row] for row in rows], processor)
    me = SimpleNamespace(model=model)
    padded = vlm.VLMChat.compute_loss(me, vlm.collate(pieces, processor))
    assert abs(vlm.VLMChat.compute_loss(me, packed) - padded) <= 1e-6 * abs(padded)


def test_where_torchvision_loads_the_familys_own_video_processor_makes_these_patches(folders, tmp_path):
    """Ground truth where transformers' Qwen2VLVideoProcessor loads: on 56 × 56 frames (no resizing,
    so no resampling to differ) its patches and grid are FramesVideoProcessor's, and the recipe hands
    a record's video to the family's own video processor when the processor has one."""
    pytest.importorskip("torchvision", reason="transformers' video processors need torchvision (PyPI's is a CUDA "
                                              "build that does not import beside the CPU torch here)")
    import transformers

    processor = vlm.load_processor(str(folders["qwen2_vl"]))
    image = processor.image_processor
    own = transformers.Qwen2VLVideoProcessor(min_pixels=image.size.shortest_edge, max_pixels=image.size.longest_edge,
                                             patch_size=14, temporal_patch_size=2, merge_size=2)
    frames = np.stack([noise(i, (56, 56)) for i in range(4)])
    mine = vlm.FramesVideoProcessor(image)([frames])
    theirs = own(videos=[frames], do_sample_frames=False, return_tensors="pt")
    assert mine["video_grid_thw"].tolist() == theirs["video_grid_thw"].tolist() == [[2, 4, 4]]
    assert torch.allclose(mine["pixel_values_videos"], theirs["pixel_values_videos"], atol=1e-5)
    whole = transformers.Qwen2VLProcessor(image_processor=image, tokenizer=processor.tokenizer, video_processor=own,
                                          chat_template=processor.chat_template)
    video = vlm.VideoRef.checked("clip", save_frames(tmp_path / "clip", list(frames)).parent, "a record", 2.0, 16)
    out = video_inputs(whole, video)
    assert torch.allclose(out["pixel_values_videos"], mine["pixel_values_videos"], atol=1e-5)


def test_frames_of_different_sizes_are_refused_naming_the_record_and_the_video(folders, tmp_path):
    save_frames(tmp_path / "clip", [noise(0, (56, 56)), noise(1, (56, 84))])
    video = vlm.VideoRef.checked("clip", tmp_path, "bad.jsonl:4", 2.0, 16)
    with pytest.raises(ConfigError, match=r"^bad.jsonl:4: the frames of video 'clip' differ in size \(\[\(56, 56\), "
                                          r"\(84, 56\)\]\); give frames of one size"):
        vlm.encode(vlm.load_processor(str(folders["qwen2_vl"])), video_turns(), [video], 512, "bad.jsonl:4")


def test_a_video_file_without_pyav_is_refused_naming_the_package(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "av", None)  # as where PyAV is not installed
    (tmp_path / "clip.mp4").write_bytes(b"\x00" * 64)
    with pytest.raises(ConfigError, match=r"^bad.jsonl:5: video 'clip.mp4' is a file, which needs PyAV \(pip install "
                                          r"av\); or give the video as a folder of its frames"):
        vlm.VideoRef.checked("clip.mp4", tmp_path, "bad.jsonl:5", 2.0, 16)


def test_the_estimate_counts_a_videos_tokens_as_a_real_forward_saves_them(folders, tmp_path):
    """estimate_run's forward on the meta model beside the real inputs (the video grid, the 3-D
    positions): the bytes saved for backward are a real forward's, and grow with the frames."""
    from tests.templates.test_vlm_chat_estimate import saved

    processor = vlm.load_processor(str(folders["qwen2_vl"]))
    estimated, real = {}, {}
    for count in (2, 8):
        save_frames(tmp_path / str(count), [noise(i, (56, 56)) for i in range(count)])
        video = vlm.VideoRef.checked(str(count), tmp_path, "a record", 2.0, 16)
        batch = vlm.collate([vlm.encode(processor, video_turns(), [video], 128, f"row {i}") for i in range(4)], processor)
        estimated[count], real[count] = (saved(folders["qwen2_vl"], batch, meta) for meta in (True, False))
    assert estimated == real and estimated[8] > estimated[2]
