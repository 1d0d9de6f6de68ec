"""Vision-language chat: a Hugging Face image-text-to-text model fine-tuned in its own chat format.

Read it top to bottom: configuration, the family (model and processor as transformers loads
them, its parts by their module names), the built-in colour questions, the data (the forms
people keep, each turned into messages with image parts), rendering (the processor's chat
template; the loss on the assistant's tokens only), batches, then the recipe class.

Supports:
- ``model.pretrained_path``: a workspace folder or a Hub id (``org/name[@rev]``, downloaded by the
  server) of LLaVA (1.5, OneVision), Qwen2-VL / Qwen2.5-VL, Idefics3 / SmolVLM, Gemma 3, PaliGemma
  and the other ``AutoModelForImageTextToText`` families; each family's own image processing
- data (``data.paths``, ``data.dataset``): LLaVA conversations (``image``/``images`` +
  ``conversations`` with ``<image>`` placeholders), messages with image content parts, image +
  caption records; JSON, JSONL, parquet, ``datasets`` folders; several images a conversation
- video (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): ``{"type": "video", "video": path}`` parts or LLaVA's ``video`` with
  ``<video>``; a folder of frames (name order) or a video file (PyAV), sampled by ``data.video_fps``
  and ``data.video_max_frames``, made as the family's video processor makes them (``FramesVideoProcessor``
  where transformers' own cannot load without torchvision)
- stages by module names (``model.train_vision_tower``, ``model.train_projector``,
  ``model.train_language_model``), FSDP2 on the family's ``_no_split_modules``
- the examples of data files encoded once into the token store (``engine/token_store.py``; large
  data as the run's first phase), mapped by every rank and later run (``StoredPieces``); images kept
  as references (``ImageRef``), their tensors made per batch, kept up to ``KEPT_IMAGE_BYTES``: a
  run's memory is bounded. The built-in examples stay in memory
- ``data.packing``: whole examples share rows, each attending to itself alone (the families of ``PACKS``)
- ``task_metrics()``: greedy answers to held-out questions through the chat template
"""

from __future__ import annotations

import bisect
import hashlib
import io
import json
import os
import re
import threading
import warnings
import zipfile
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from functools import cached_property
from itertools import islice
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field, model_validator
from torch.distributed.checkpoint.stateful import Stateful

from engine.chat import assistant_spans, render
from engine.config import ConfigError, EngineConfig, Section
from engine.data_files import DataListing, DataPathRefused, confined_path, data_files, open_data_file
from engine.data_formats import FILE_SUFFIXES, is_saved_dataset, sources
from engine.engine import IGNORE_INDEX, Engine
from engine.flops import non_embedding_params, transformer_flops_per_token
from engine.fsdp import apply_fsdp
from engine.run_dir import DataSummary
from engine.token_store import (
    HEAD_RECORDS,
    StoredDataConfig,
    TokenStore,
    check_disk_space,
    data_identity,
    leave_to_run,
    left_to_run,
    open_or_build,
    store_key,
    text_size,
)

# =============================================================================================
# Configuration
# =============================================================================================


class ModelConfig(Section):
    pretrained_path: str | None = Field(
        None,
        description="The model: a workspace folder or a Hub id (org/name[@rev]) of an image-text-to-text family.",
    )
    train_vision_tower: bool = Field(False, description="The vision tower trains too.")
    train_projector: bool = Field(True, description="The projector (connector, merger) trains.")
    train_language_model: bool = Field(True, description="The language model and its head train.")
    attn_implementation: str = Field("sdpa", description="Attention kernel: sdpa, eager, flash_attention_2.")


class VLMChatDataConfig(StoredDataConfig):
    seq_len: int = Field(512, ge=8, description="Tokens per sequence, image tokens included.")
    paths: list[str] = Field(default_factory=list, description="Data files or folders (.jsonl, .json, .parquet, saved data sets).")
    dataset: str | None = Field(None, description="A data set for datasets.load_dataset: a workspace folder or a Hub id.")
    subset: str | None = Field(None, description="data.dataset's configuration.")
    split: str | None = Field(None, description="data.dataset's split (default: train).")
    format: str | None = Field(None, description="llava | messages | caption; recognised from the records when unset.")
    caption_prompt: str = Field("Describe the image.", description="The user's question of a caption record.")
    eval_fraction: float = Field(0.05, ge=0, le=1, description="Examples held out (1: all, for `trainwright evaluate`).")
    eval_prompts: int = Field(32, ge=1, description="Held-out questions task_metrics() answers.")
    builtin_images: int = Field(2000, ge=10, description="No data given: how many colour questions.")
    builtin_image_size: int = Field(56, ge=8, description="Side of the built-in images.")
    video_fps: float = Field(2.0, gt=0, description="Frames a second a video file is sampled at; a folder's frames are "
                             "taken as this rate.")
    video_max_frames: int = Field(16, ge=1, description="At most this many frames a video (sampled evenly).")
    packing: bool = Field(False, description="Whole examples share rows of seq_len (batch_size counts rows), each "
                          "attending to itself alone; the families of PACKS.")

    @model_validator(mode="after")
    def _known_format(self) -> "VLMChatDataConfig":
        if self.format is not None and self.format not in FORMATS:
            raise ValueError(f"data.format={self.format!r}; give one of {', '.join(FORMATS)} or leave it unset")
        return self


class VLMChatConfig(EngineConfig):
    model: ModelConfig = ModelConfig()
    data: VLMChatDataConfig = VLMChatDataConfig()


# =============================================================================================
# The family: processor and model as transformers loads them; its parts by module name
# =============================================================================================

# Each part's module names across the families (transformers' own names, after the model's prefix).
PARTS = {
    "vision_tower": ("vision_tower", "visual", "vision_model"),
    "projector": ("multi_modal_projector", "connector", "visual.merger", "image_newline"),
    "language_model": ("language_model", "text_model", "lm_head"),
}


def model_folder(raw: str | None) -> Path:
    """The model's folder: a workspace folder, or the snapshot the server bound for a Hub id."""
    if not raw:
        raise ConfigError("model.pretrained_path is required: a workspace folder or a Hub id (org/name[@rev]) of an "
                          "image-text-to-text model (LLaVA, Qwen2-VL, Idefics3/SmolVLM, Gemma 3, LLaVA-OneVision ...)")
    folder = Path(confined_path(raw))
    if not folder.is_dir():
        raise ConfigError(f"model.pretrained_path={raw} is no folder here and no Hub snapshot was bound for it; give a "
                          "model folder in the workspace, or a Hub id (org/name[@rev]) to a launch, which downloads it")
    if not (folder / "config.json").is_file():
        raise ConfigError(f"model.pretrained_path={raw}: no config.json in {folder}; give a Hugging Face model folder "
                          "or a Hub id the server downloads (launch_run)")
    return folder


def family_of(folder: Path) -> str:
    return str(json.loads((folder / "config.json").read_text()).get("model_type", "unknown"))


def processor_class_name(folder: Path) -> str | None:
    for name in ("processor_config.json", "preprocessor_config.json", "tokenizer_config.json"):
        path = folder / name
        if path.is_file():
            value = json.loads(path.read_text()).get("processor_class")
            if isinstance(value, str):
                return value
    return None


def torchvision_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("torchvision") is not None


def without_video(processor_class: type) -> type:
    """``processor_class`` taking no video processor: its image processor and tokenizer alone.
    transformers' video processors need torchvision; the images of a family whose processor
    also takes video (Qwen2-VL) need only the image processor (its PIL version). Saved, it is
    the family's own class (its name and files), which loads whole where torchvision is."""

    import inspect

    # transformers saves and loads a processor's settings (num_image_tokens, ...) by the names
    # its __init__'s code takes: the new __init__ takes the same names, less video_processor.
    names = [name for name, p in inspect.signature(processor_class.__init__).parameters.items()
             if name not in ("self", "video_processor") and p.kind is p.POSITIONAL_OR_KEYWORD]
    defaults = {name: p.default for name, p in inspect.signature(processor_class.__init__).parameters.items()}
    source = (f"def __init__(self, {', '.join(f'{n}=defaults[{n!r}]' for n in names)}, **kwargs):\n"
              f"    init(self, video_processor=None, {', '.join(f'{n}={n}' for n in names)}, **kwargs)\n")
    scope = {"defaults": {n: None if defaults[n] is inspect.Parameter.empty else defaults[n] for n in names},
             "init": processor_class.__init__}
    exec(source, scope)  # noqa: S102 (a signature built from transformers' own names)
    __init__ = scope["__init__"]
    return type(processor_class.__name__, (processor_class,), {"__init__": __init__,
                                                                "__module__": processor_class.__module__})


def takes_video(processor_class: type) -> bool:
    import inspect

    return "video_processor" in inspect.signature(processor_class.__init__).parameters


PROCESSOR_FILES = {
    "its image processor's settings": ("preprocessor_config.json", "processor_config.json"),
    "its tokenizer": ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json"),
}


def first_sentence(error: BaseException) -> str:
    """A third-party error as one whole sentence (its first), never cut mid-word."""
    text = " ".join(str(error).split()) or type(error).__name__
    return re.split(r"(?<=[.!?])\s", text, maxsplit=1)[0]


def load_processor(raw: str):
    """The model's processor (the class its files name), with the chat template it ships."""
    import transformers

    folder = model_folder(raw)
    family = family_of(folder)
    for what, names in PROCESSOR_FILES.items():
        if not any((folder / name).is_file() for name in names):
            raise ConfigError(f"model.pretrained_path={raw} ({family}) has no processor: {what} ({' or '.join(names)}) "
                              "is missing; save the model's processor beside it (processor.save_pretrained)")
    name = processor_class_name(folder)
    if name is None:
        raise ConfigError(f"model.pretrained_path={raw} ({family}) names no processor class (processor_class in "
                          "processor_config.json): save the model's processor beside it (processor.save_pretrained)")
    processor_class = getattr(transformers, name, None)
    if processor_class is None:
        raise ConfigError(f"model.pretrained_path={raw} ({family}) needs the processor {name}, which transformers "
                          f"{transformers.__version__} does not have; upgrade transformers")
    if takes_video(processor_class) and not torchvision_available():
        processor_class = without_video(processor_class)
    try:
        processor = processor_class.from_pretrained(folder)
    except ImportError as e:
        missing = f"the package {e.name}" if e.name else first_sentence(e)
        raise ConfigError(f"model.pretrained_path={raw} ({family}): its processor {name} needs {missing}, "
                          "which is not installed") from None
    except (ValueError, OSError, TypeError, AttributeError, KeyError) as e:
        raise ConfigError(f"model.pretrained_path={raw} ({family}): its processor {name} cannot be loaded from "
                          f"{folder}: {type(e).__name__}: {first_sentence(e)}") from None
    if not isinstance(getattr(processor, "chat_template", None), str) and not prefix_suffix(processor):
        raise ConfigError(f"model.pretrained_path={raw} ({family}): its processor {name} has no chat template "
                          "and takes no suffix (PaliGemma's prefix/suffix form); save the model's chat_template.jinja "
                          "beside it")
    if getattr(processor.tokenizer, "pad_token_id", None) is None:
        processor.tokenizer.pad_token = processor.tokenizer.eos_token
    if getattr(processor, "video_processor", None) is None and name in FRAMES_VIDEO:
        # Not an attribute transformers saves: the export is the family's own processor.
        processor.frames_video = FramesVideoProcessor(processor.image_processor, saved_video_settings(folder, name))
    return processor


def prefix_suffix(processor) -> bool:
    """A family with no chat by design (PaliGemma): the user's text is the processor's prefix and
    the answer its ``suffix``, whose tokens alone carry the loss (the processor's ``labels``)."""
    import inspect

    return (not isinstance(getattr(processor, "chat_template", None), str)
            and "suffix" in inspect.signature(type(processor).__call__).parameters)


def load_model(cfg: ModelConfig) -> torch.nn.Module:
    import transformers
    from transformers import AutoConfig, AutoModelForImageTextToText

    folder = model_folder(cfg.pretrained_path)
    config = AutoConfig.from_pretrained(folder)
    known = transformers.models.auto.modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
    if config.model_type not in known:
        raise ConfigError(f"model.pretrained_path={cfg.pretrained_path} is a {config.model_type} model, which "
                          f"AutoModelForImageTextToText does not load; give an image-text-to-text model")
    return AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32,
                                                       attn_implementation=cfg.attn_implementation)


def model_on_meta(cfg: ModelConfig) -> torch.nn.Module:
    """The model's modules on the meta device, no weights read: where the examples' 3-D positions
    come from before the run's model is built (estimate_run builds the data first)."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    with torch.device("meta"):
        return AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(model_folder(cfg.pretrained_path)))


def model_parts(model: torch.nn.Module) -> dict[str, list[str]]:
    """Each part's modules by name (``model.vision_tower``, ``model.visual.merger``, ...)."""
    found: dict[str, list[str]] = {part: [] for part in PARTS}
    names = [name for name, _ in model.named_modules()] + [name for name, _ in model.named_parameters()]
    for part, suffixes in PARTS.items():
        for name in names:
            tail = name.removeprefix("model.")
            if tail in suffixes and not any(name.startswith(f + ".") for f in found[part]):
                found[part].append(name)
    return found


def freeze_parts(model: torch.nn.Module, cfg: ModelConfig) -> dict[str, list[str]]:
    """Freeze what the stage does not train; the projector inside a vision tower (Qwen's merger)
    follows ``train_projector``. Returns the parts found."""
    parts = model_parts(model)
    if not parts["language_model"] or not parts["vision_tower"]:
        raise ConfigError(f"{type(model).__name__}: no vision tower or language model among its modules "
                          f"(looked for {PARTS['vision_tower']} and {PARTS['language_model']})")
    training = {"vision_tower": cfg.train_vision_tower, "projector": cfg.train_projector,
                "language_model": cfg.train_language_model}
    owner: dict[str, str] = {}
    for part in ("vision_tower", "language_model", "projector"):  # the projector's names are the longest
        for name in parts[part]:
            owner[name] = part
    for name, param in model.named_parameters():
        prefixes = [p for p in owner if name == p or name.startswith(p + ".")]
        part = owner[max(prefixes, key=len)] if prefixes else "language_model"
        param.requires_grad_(training[part])
    return parts


def image_token_ids(processor) -> set[int]:
    """The ids of the tokens that stand for images (or video): never learnt."""
    tokenizer = processor.tokenizer
    ids = set()
    for attribute in ("image_token", "video_token", "boi_token", "eoi_token", "fake_image_token", "global_image_tag"):
        token = getattr(processor, attribute, None)
        if isinstance(token, str):
            token_id = tokenizer.convert_tokens_to_ids(token)
            if isinstance(token_id, int) and token_id != tokenizer.unk_token_id:
                ids.add(token_id)
    for attribute in ("image_token_id", "video_token_id"):
        if isinstance(getattr(processor, attribute, None), int):
            ids.add(getattr(processor, attribute))
    return ids


@contextmanager
def logits_only_at(model: torch.nn.Module, positions: torch.Tensor) -> Iterator[None]:
    """Inside it, the model's output layer maps the hidden states at ``positions`` (a boolean
    mask over the batch's tokens) alone to logits, ``(n, vocab)``: only the tokens the loss
    covers go through the vocabulary (32 k to 262 k entries in these families), not every image,
    prompt and padding token. A family that calls its head otherwise gets every position's."""
    def keep(_, args):
        return (args[0][positions], *args[1:]) if args and args[0].shape[:-1] == positions.shape else None

    handle = model.get_output_embeddings().register_forward_pre_hook(keep)
    try:
        yield
    finally:
        handle.remove()


# The families whose packed rows train as their examples do alone (test_vlm_chat.py checks each, on
# CPU with sdpa): without an attention_mask, transformers keeps each example's attention to itself
# from position ids that restart at its first token (a block-diagonal causal mask; flash-attention's
# varlen on a GPU), Qwen's 3-D positions computed per example.
PACKS = ("qwen2_vl", "qwen2_5_vl", "llava", "idefics3", "gemma3", "llava_onevision")


def check_packing(config: VLMChatConfig) -> None:
    if not config.data.packing:
        return
    family = family_of(model_folder(config.model.pretrained_path))
    if family not in PACKS:
        raise ConfigError(f"data.packing=true: {family} models are not known to keep a packed example's attention "
                          f"to itself (packing is checked for {', '.join(PACKS)}); set data.packing=false")


# =============================================================================================
# The built-in task: what colour is the shape?
# =============================================================================================

COLOURS = {"red": (220, 40, 40), "green": (40, 200, 60), "blue": (50, 80, 230), "yellow": (230, 210, 40)}
QUESTION = "What colour is the shape?"


def colour_image(colour: str, size: int, rng: np.random.Generator):
    """A square of ``colour`` on a noisy dark background, jittered in place, size and shade."""
    from PIL import Image

    image = rng.integers(0, 40, (size, size, 3)).astype(np.float64)
    side = int(size * rng.uniform(0.4, 0.6))
    x, y = rng.integers(0, size - side + 1, 2)
    image[y:y + side, x:x + side] = np.array(COLOURS[colour]) * rng.uniform(0.8, 1.1)
    return Image.fromarray(np.clip(image, 0, 255).astype(np.uint8))


def builtin_examples(count: int, size: int, seed: int = 0) -> list[tuple[str, list, list]]:
    examples = []
    for i in range(count):
        rng = np.random.default_rng([seed, i])
        colour = list(COLOURS)[rng.integers(len(COLOURS))]
        messages = [user_turn([QUESTION], 1), assistant_turn(colour)]
        examples.append((f"builtin-{i}", messages, [colour_image(colour, size, rng)]))
    return examples


# =============================================================================================
# Data: the forms people keep, each as (where, messages with image parts, images)
# =============================================================================================

# format -> the columns that tell it, in the order formats are recognised.
FORMATS = {"llava": ("conversations",), "messages": ("messages",), "caption": ("image", "caption")}
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "model": "assistant",
         "system": "system"}
PLACEHOLDER = "<image>"
VIDEO_PLACEHOLDER = "<video>"


@dataclass(frozen=True)
class VideoPart:
    """A record's video (a path) among its images, in the order of its parts."""

    value: Any


def user_turn(texts: list[str], images_before: int = 0, role: str = "user") -> dict[str, Any]:
    return {"role": role, "content": [{"type": "image"}] * images_before + [{"type": "text", "text": t} for t in texts]}


def assistant_turn(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": [{"type": "text", "text": text}]}


def detect_format(record: dict[str, Any], where: str, forced: str | None) -> str:
    if forced:
        return forced
    for fmt, columns in FORMATS.items():
        if all(column in record for column in columns):
            return fmt
    raise ConfigError(f"{where}: no format has these columns {sorted(record)[:10]}; a record is LLaVA's "
                      '{"image", "conversations": [{"from", "value"}]}, {"messages": [{"role", "content"}]} with '
                      '{"type": "image", "image": path} parts, or {"image", "caption"} (or set data.format)')


def _text(value: Any, where: str, what: str) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{where}: {what} must be text, got {type(value).__name__}")
    return value


def llava_messages(record: dict[str, Any], where: str) -> tuple[list, list]:
    """LLaVA's ``conversations``: ``<image>`` in a turn's value is where an image goes, ``<video>``
    where the record's ``video`` (or the next of its ``videos``) goes."""
    images = record.get("images", record.get("image"))
    images = [] if images is None else images if isinstance(images, list) else [images]
    videos = record.get("videos", record.get("video"))
    videos = [] if videos is None else videos if isinstance(videos, list) else [videos]
    media, placed_videos = [], 0
    turns = record["conversations"]
    if not isinstance(turns, list) or not all(isinstance(t, dict) for t in turns):
        raise ConfigError(f'{where}: "conversations" must be a list of {{"from", "value"}} objects')
    messages, placed = [], 0
    for index, turn in enumerate(turns, 1):
        role = ROLES.get(str(turn.get("from", turn.get("role"))))
        if role is None:
            raise ConfigError(f"{where}: turn {index} is from {turn.get('from')!r}; give one of {', '.join(ROLES)}")
        value = _text(turn.get("value", turn.get("content")), where, f"turn {index}'s value")
        pieces = re.split(f"({re.escape(PLACEHOLDER)}|{re.escape(VIDEO_PLACEHOLDER)})", value)
        content: list[dict[str, Any]] = []
        for piece in pieces:
            if piece in (PLACEHOLDER, VIDEO_PLACEHOLDER):
                if role == "assistant":
                    raise ConfigError(f"{where}: turn {index} (the assistant's) holds {piece}; images and videos go "
                                      "in user turns")
                video = piece == VIDEO_PLACEHOLDER
                content.append({"type": "video" if video else "image"})
                at = placed_videos if video else placed
                given = videos if video else images
                if at < len(given):
                    media.append(VideoPart(given[at]) if video else given[at])
                placed_videos, placed = placed_videos + video, placed + (not video)
            elif piece.strip():
                content.append({"type": "text", "text": piece.strip()})
        messages.append({"role": role, "content": content})
    if placed != len(images):
        raise ConfigError(f"{where}: {placed} {PLACEHOLDER} placeholder(s) for {len(images)} image(s); "
                          f"put one {PLACEHOLDER} in the conversation for each image")
    if placed_videos != len(videos):
        raise ConfigError(f"{where}: {placed_videos} {VIDEO_PLACEHOLDER} placeholder(s) for {len(videos)} video(s); "
                          f"put one {VIDEO_PLACEHOLDER} in the conversation for each video")
    return messages, media


def content_messages(record: dict[str, Any], where: str) -> tuple[list, list]:
    """``messages`` whose content is text or parts: ``{"type": "image", "image": path}`` (or a
    bare ``{"type": "image"}`` taking the next of the record's ``images``), ``{"type": "text"}``."""
    given = record.get("images")
    spare = list(given) if isinstance(given, list) else [] if given is None else [given]
    messages, images = [], []
    if not isinstance(record["messages"], list):
        raise ConfigError(f'{where}: "messages" must be a list of {{"role", "content"}} objects')
    for index, message in enumerate(record["messages"], 1):
        role = ROLES.get(str(message.get("role"))) if isinstance(message, dict) else None
        if role is None:
            raise ConfigError(f"{where}: message {index} needs a role of {', '.join(sorted(set(ROLES.values())))}")
        content = message.get("content")
        parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(parts, list):
            raise ConfigError(f"{where}: message {index}'s content must be text or a list of parts")
        kept: list[dict[str, Any]] = []
        for part in parts:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "image":
                image = part.get("image", part.get("path", part.get("url")))
                if image is None:
                    if not spare:
                        raise ConfigError(f"{where}: message {index} has an image part with no image and the record's "
                                          '"images" has none left')
                    image = spare.pop(0)
                if role == "assistant":
                    raise ConfigError(f"{where}: message {index} (the assistant's) holds an image; images go in user turns")
                images.append(image)
                kept.append({"type": "image"})
            elif kind == "video":
                video = part.get("video", part.get("path"))
                if role == "assistant":
                    raise ConfigError(f"{where}: message {index} (the assistant's) holds a video; videos go in user turns")
                if not isinstance(video, str) or not video:
                    raise ConfigError(f'{where}: message {index} has a video part with no "video" path (a folder of '
                                      "frames or a video file)")
                images.append(VideoPart(video))
                kept.append({"type": "video"})
            elif kind == "text":
                kept.append({"type": "text", "text": _text(part.get("text"), where, f"message {index}'s text")})
            else:
                raise ConfigError(f"{where}: message {index} has a part of type {kind!r}; give image, video or text parts")
        messages.append({"role": role, "content": kept})
    if spare:
        raise ConfigError(f'{where}: {len(spare)} of the record\'s "images" have no image part; add a '
                          '{"type": "image"} part for each')
    return messages, images


def caption_messages(record: dict[str, Any], where: str, prompt: str) -> tuple[list, list]:
    caption = _text(record["caption"], where, '"caption"')
    if not caption.strip():
        raise ConfigError(f"{where}: the caption is empty")
    return [user_turn([prompt], 1), assistant_turn(caption)], [record["image"]]


def read_image(value: Any, base: Path | None, where: str, header_only: bool = False):
    """An image of a record: a path (relative to the data file, confined to the workspace), the
    bytes of an image file, a ``{"bytes", "path"}`` of a data set's image column, or an image.
    ``header_only``: its header checked (its size against PIL's bomb limit), nothing decoded: its
    ``(height, width)`` as the header gives it (the picture is used as stored, no EXIF turn)."""
    from PIL import Image

    if isinstance(value, dict):
        value = value.get("bytes") or value.get("path")
    try:
        if isinstance(value, Image.Image):
            return value.size[::-1] if header_only else value.convert("RGB")
        # PIL refuses an image over twice MAX_IMAGE_PIXELS and only warns over it: a PNG of a few
        # KB in that band decodes to hundreds of MB. Refused unread, as over twice it is.
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            if isinstance(value, (bytes, bytearray)):
                with Image.open(io.BytesIO(value)) as image:
                    return image.size[::-1] if header_only else image.convert("RGB")
            if not isinstance(value, str) or not value:
                raise ConfigError(f"{where}: an image is a path, bytes or an image, got {type(value).__name__}")
            with open_data_file(str(base / value) if base is not None else value) as file, Image.open(file) as image:
                return image.size[::-1] if header_only else image.convert("RGB")
    except (DataPathRefused, ConfigError):
        raise
    except (OSError, ValueError, Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        shown = value if isinstance(value, str) else f"{len(value)} bytes"
        raise ConfigError(f"{where}: image {shown!r} cannot be read ({e})") from None


@dataclass(frozen=True)
class ImageRef:
    """An image as a record holds it (a path, the bytes of a file, a data set's image), read when
    a batch needs it: a run keeps references, never decoded pictures or their pixels."""

    value: Any
    base: Path | None
    where: str
    size: tuple[int, int] | None = None  # (height, width) as its header gives it

    def open(self):
        return read_image(self.value, self.base, self.where)

    @classmethod
    def checked(cls, value: Any, base: Path | None, where: str) -> "ImageRef":
        """The reference, once its image is found, confined and its header read (a missing, unreadable
        or bomb image is refused here, before anything trains); a data set's ``{"bytes", "path"}``
        keeps its bytes or path alone."""
        if isinstance(value, dict):
            value = value.get("bytes") or value.get("path")
        return cls(value, base, where, read_image(value, base, where, header_only=True))


def image_of(image):
    """The picture of an ``ImageRef``, or of a picture given as it is (the built-in ones, ``sample``'s)."""
    return image.open() if isinstance(image, ImageRef) else image


# =============================================================================================
# Video: a folder of frames or a video file, sampled and processed as the family's video processor does
# =============================================================================================

FRAME_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
# The processors whose video this template makes from the frames itself where transformers' video
# processors cannot load (they need torchvision): Qwen2-VL's, Qwen2.5-VL's and Qwen3-VL's temporal patches.
FRAMES_VIDEO = ("Qwen2VLProcessor", "Qwen2_5_VLProcessor", "Qwen3VLProcessor")
# The settings of a video processor the frames are made by, as a model folder saves them.
VIDEO_SETTINGS = ("size", "min_pixels", "max_pixels", "image_mean", "image_std", "patch_size", "temporal_patch_size",
                  "merge_size")
# transformers' own video processors' pixel bounds (Qwen2VLVideoProcessor.size, Qwen3VLVideoProcessor.size),
# for a model folder that saves no video processor settings: a frame's pixels, not an image's.
VIDEO_SIZES = {"Qwen2VLProcessor": {"shortest_edge": 128 * 28 * 28, "longest_edge": 28 * 28 * 768},
               "Qwen2_5_VLProcessor": {"shortest_edge": 128 * 28 * 28, "longest_edge": 28 * 28 * 768},
               "Qwen3VLProcessor": {"shortest_edge": 128 * 32 * 32, "longest_edge": 32 * 32 * 768}}


def saved_video_settings(folder: Path, processor_class: str) -> dict[str, Any]:
    """The video processor's settings a model folder saves (``processor_config.json``'s
    ``video_processor``, or ``video_preprocessor_config.json``), else transformers' default pixel bounds."""
    saved: dict[str, Any] = {}
    config = folder / "processor_config.json"
    if config.is_file():
        saved = json.loads(config.read_text()).get("video_processor") or {}
    if not saved and (folder / "video_preprocessor_config.json").is_file():
        saved = json.loads((folder / "video_preprocessor_config.json").read_text())
    settings = {key: saved[key] for key in VIDEO_SETTINGS if saved.get(key) is not None}
    if not any(key in settings for key in ("size", "min_pixels", "max_pixels")) and processor_class in VIDEO_SIZES:
        settings["size"] = VIDEO_SIZES[processor_class]
    return settings


def frame_order(name: str) -> list:
    """Frames in name order, numbers by value (``frame_9`` before ``frame_10``)."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def sampled_frames(total: int, temporal: int, max_frames: int, fps: float | None = None,
                   video_fps: float | None = None) -> list[int]:
    """The indices of the frames transformers' ``sample_frames`` of Qwen2-VL takes: ``fps`` a second
    of a video at ``video_fps`` (a folder of frames: every frame), at most ``max_frames``, a multiple
    of ``temporal`` spread evenly; fewer frames than a temporal patch: all (patching repeats the last)."""
    count = total if fps is None or not video_fps else total / video_fps * fps
    count = int(min(count, max_frames, total) // temporal * temporal)
    if count < temporal:
        return list(range(total))
    return torch.arange(0, total, total / count).int().tolist()


@dataclass(frozen=True)
class VideoRef:
    """A video as a record names it (a folder of frames or a video file, relative to the data file
    and confined to the workspace), its frames read and sampled when a batch needs them."""

    value: str
    base: Path | None
    where: str
    fps: float
    max_frames: int

    def path(self) -> str:
        return str(self.base / self.value) if self.base is not None else self.value

    def frame_files(self) -> list[Path]:
        """A folder's frames in name order (confined as data files are), or [] for a file."""
        if not Path(self.path()).is_dir():
            return []
        found = [path for path, _ in data_files([self.path()], suffixes=FRAME_SUFFIXES, fingerprint=False)]
        if not found:
            raise ConfigError(f"{self.where}: video {self.value!r} is a folder with no frames "
                              f"({', '.join(FRAME_SUFFIXES)}); put the video's frames in it or name a video file")
        return sorted(found, key=lambda path: frame_order(path.name))

    def open(self, temporal: int):
        """``(frames, metadata)``: the sampled frames as RGB pictures, and transformers' ``VideoMetadata``."""
        from transformers.video_utils import VideoMetadata

        files = self.frame_files()
        if files:
            picked = sampled_frames(len(files), temporal, self.max_frames)
            frames = [read_image(str(files[i]), None, self.where) for i in picked]
            sizes = {frame.size for frame in frames}
            if len(sizes) > 1:
                raise ConfigError(f"{self.where}: the frames of video {self.value!r} differ in size ({sorted(sizes)}); "
                                  "give frames of one size")
            return frames, VideoMetadata(total_num_frames=len(files), fps=self.fps, frames_indices=picked)
        return decode_video(self, temporal)

    @classmethod
    def checked(cls, value: Any, base: Path | None, where: str, fps: float, max_frames: int) -> "VideoRef":
        """The reference, once its folder (a frame's header read) or its file (its first frame decoded) is
        found, confined and readable: a missing, empty or unreadable video is refused here, before anything trains."""
        if not isinstance(value, str) or not value:
            raise ConfigError(f"{where}: a video is the path of a folder of frames or of a video file, got {value!r}")
        video = cls(value, base, where, fps, max_frames)
        if not Path(video.path()).exists():
            raise ConfigError(f"{where}: video {value!r} does not exist (a path relative to the data file)")
        files = video.frame_files()
        if files:
            read_image(str(files[0]), None, where, header_only=True)
        else:
            decode_video(video, 1, count_only=True)
        return video


def decode_video(video: VideoRef, temporal: int, count_only: bool = False):
    """A video file's sampled frames through PyAV (FFmpeg): ``(frames, VideoMetadata)``, its frames
    counted as its stream says (as transformers' PyAV loader counts them) or, where it says none or
    a wrong count, by decoding them; ``count_only``: the file opened and its first frame decoded."""
    from transformers.video_utils import VideoMetadata

    try:
        import av
    except ImportError:
        raise ConfigError(f"{video.where}: video {video.value!r} is a file, which needs PyAV (pip install av); "
                          "or give the video as a folder of its frames") from None
    try:
        file = open_data_file(video.path())  # the file confined is the one decoded, whatever its path becomes
    except DataPathRefused:
        raise
    except OSError as e:
        raise ConfigError(f"{video.where}: video {video.value!r} cannot be read ({e})") from None
    try:
        with file, av.open(file) as container:
            stream = container.streams.video[0]
            rate = float(stream.average_rate or stream.guessed_rate or 0) or None
            if count_only:
                total = 1 if next(container.decode(video=0), None) is not None else 0
            else:
                total = stream.frames or decoded_frames(container, [])[0]
                picked = sampled_frames(total, temporal, video.max_frames, video.fps, rate) if total else []
                count, frames = decoded_frames(container, picked)
                if count != total:  # the stream's count was not its frames'
                    total = count
                    picked = sampled_frames(total, temporal, video.max_frames, video.fps, rate) if total else []
                    frames = decoded_frames(container, picked)[1]
    except (av.error.FFmpegError, IndexError, OSError, ValueError) as e:
        raise ConfigError(f"{video.where}: video {video.value!r} cannot be read as a video ({first_sentence(e)})") from None
    if not total:
        raise ConfigError(f"{video.where}: video {video.value!r} has no frames")
    if count_only:
        return [], None
    return frames, VideoMetadata(total_num_frames=total, fps=rate, frames_indices=picked)


def decoded_frames(container, picked: list[int]) -> tuple[int, list]:
    """A video's frames from its start: how many there are, and the pictures of those ``picked``."""
    container.seek(0)
    wanted, kept, count = set(picked), [], 0
    for count, frame in enumerate(container.decode(video=0), 1):
        if count - 1 in wanted:
            kept.append(frame.to_image().convert("RGB"))
    return count, kept


class FramesVideoProcessor:
    """Qwen2-VL's video processing (transformers' ``Qwen2VLVideoProcessor``) on its image
    processor's PIL path: each frame (all of one size) resized by ``smart_resize`` within the video
    settings' pixel bounds, rescaled and normalized as an image is, then ``temporal_patch_size`` consecutive frames make a temporal
    patch where an image repeats its one frame (a short video's last frame repeated to fill one);
    ``video_grid_thw`` is (patches in time, height, width). For the families of ``FRAMES_VIDEO`` where
    torchvision, which transformers' video processors need, cannot be imported."""

    def __init__(self, image_processor, settings: dict[str, Any] | None = None):
        self.image_processor, self.settings = image_processor, dict(settings or {})
        if "min_pixels" in self.settings or "max_pixels" in self.settings:
            size = dict(self.settings.get("size") or {})
            size["shortest_edge"] = self.settings.pop("min_pixels", size.get("shortest_edge"))
            size["longest_edge"] = self.settings.pop("max_pixels", size.get("longest_edge"))
            self.settings["size"] = size
        self.merge_size = self.settings.get("merge_size", image_processor.merge_size)
        self.temporal_patch_size = self.settings.get("temporal_patch_size", image_processor.temporal_patch_size)
        self.patch_size = self.settings.get("patch_size", image_processor.patch_size)

    def patches(self, frames: list) -> tuple[np.ndarray, list[int]]:
        temporal, patch = self.temporal_patch_size, self.patch_size
        frames = frames + frames[-1:] * (-len(frames) % temporal)
        # Each frame as the image processor makes an image: (patches, channel, temporal copies, patch, patch).
        singles = [self.image_processor(images=[frame], return_tensors="np", **self.settings) for frame in frames]
        grid = singles[0]["image_grid_thw"][0].tolist()
        one = [s["pixel_values"].reshape(len(s["pixel_values"]), -1, temporal, patch, patch)[:, :, 0] for s in singles]
        groups = [np.stack(one[t:t + temporal], axis=2) for t in range(0, len(one), temporal)]
        return np.concatenate([g.reshape(len(g), -1) for g in groups]), [len(groups), grid[1], grid[2]]

    def __call__(self, videos, **kwargs):
        from transformers import BatchFeature

        made = [self.patches(list(frames)) for frames in videos]
        return BatchFeature({"pixel_values_videos": torch.from_numpy(np.concatenate([m[0] for m in made])),
                             "video_grid_thw": torch.tensor([m[1] for m in made]),
                             "video_metadata": kwargs.get("video_metadata")})


def video_processor_of(processor, where: str):
    """The processor that makes a record's video inputs: the family's own where its video processor
    loaded, a copy with ``FramesVideoProcessor`` for the families of ``FRAMES_VIDEO``; else refused."""
    import copy

    name = type(processor).__name__
    if getattr(processor, "video_processor", None) is not None:
        return processor
    if name in FRAMES_VIDEO:
        with_frames = copy.copy(processor)
        # load_processor's, with the model folder's video settings; else the image processor's own
        with_frames.video_processor = getattr(processor, "frames_video", None) or FramesVideoProcessor(
            processor.image_processor)
        return with_frames
    family = name.removesuffix("Processor")
    if takes_video(type(processor)) or takes_video(type(processor).__base__):  # without_video's base
        raise ConfigError(f"{where}: a video, and the family {family} takes video only through its own video processor, "
                          "which needs torchvision (not importable here); give its frames as images")
    raise ConfigError(f"{where}: a video, and the family {family} takes images only; give the video's frames as images "
                      "or a family that takes video (Qwen2-VL, Qwen2.5-VL, Qwen3-VL)")


def size_of(image) -> tuple[int, int]:
    """``(height, width)`` of an ``ImageRef`` (as its header gives it) or of a picture, nothing decoded."""
    if isinstance(image, ImageRef):
        return image.size or read_image(image.value, image.base, image.where, header_only=True)
    return image.size[::-1]


def record_sources(cfg: VLMChatDataConfig) -> Iterator[tuple[Path | None, Iterator[tuple[str, dict[str, Any]]]]]:
    """``(folder image paths are relative to, rows)`` of each file, saved folder and data set."""
    for raw in cfg.paths:
        if is_saved_dataset(Path(raw)):
            for _, rows in sources([raw], split=cfg.split):
                yield Path(confined_path(raw)), rows
            continue
        for path, name in data_files([raw], suffixes=FILE_SUFFIXES):
            for _, rows in sources([str(path)]):
                yield path.parent, ((f"{name}:{w.rsplit(':', 1)[1]}", r) for w, r in rows)
    if cfg.dataset:
        for _, rows in sources([], cfg.dataset, cfg.subset, cfg.split):
            yield None, rows


def load_examples(cfg: VLMChatDataConfig) -> tuple[list[tuple[str, list, list]], list[str]]:
    """``(where, messages, images)`` of every record (its images as ``ImageRef``), and the formats read."""
    if not cfg.paths and not cfg.dataset:
        return builtin_examples(cfg.builtin_images, cfg.builtin_image_size), ["builtin"]
    formats: list[str] = []
    return list(read_examples(cfg, formats)), formats


def record_messages(cfg: VLMChatDataConfig, record: dict[str, Any], where: str) -> tuple[str, list, list]:
    """``(format, messages, media)`` of a record, its media as the record names them (nothing read)."""
    fmt = detect_format(record, where, cfg.format)
    if fmt == "llava":
        messages, media = llava_messages(record, where)
    elif fmt == "messages":
        messages, media = content_messages(record, where)
    else:
        messages, media = caption_messages(record, where, cfg.caption_prompt)
    if not any(m["role"] == "assistant" for m in messages):
        raise ConfigError(f"{where}: the conversation has no assistant turn: nothing to learn")
    return fmt, messages, media


def named_media_bytes(cfg: VLMChatDataConfig, limit: float) -> int:
    """The bytes of the image and video files the records name by path (a data set's image bytes
    are in its files already), the records read until they pass ``limit``: what decides whether
    the launch check encodes the data (its images are most of the work) or leaves it to the run."""
    total = 0
    for base, rows in record_sources(cfg):
        for where, record in rows:
            for item in record_messages(cfg, record, where)[2]:
                value = item.value if isinstance(item, VideoPart) else item
                if isinstance(value, dict):
                    value = value.get("path") if not value.get("bytes") else None
                if isinstance(value, str) and value:
                    with suppress(OSError):  # a missing file is refused when the head is encoded
                        total += os.stat(base / value if base is not None else value).st_size
            if total > limit:
                return total
    return total


def read_examples(cfg: VLMChatDataConfig, formats: list[str] | None = None,
                  head: int | None = None) -> Iterator[tuple[str, list, list]]:
    """The ``(where, messages, images)`` of :func:`load_examples`' records, read one at a time (each
    format read appended to ``formats``); ``head``: the first records of each source alone."""
    found = False
    for base, rows in record_sources(cfg):
        for where, record in islice(rows, head):
            fmt, messages, images = record_messages(cfg, record, where)
            if formats is not None and fmt not in formats:
                formats.append(fmt)
            found = True
            yield where, messages, [
                VideoRef.checked(item.value, base, where, cfg.video_fps, cfg.video_max_frames)
                if isinstance(item, VideoPart) else ImageRef.checked(item, base, where) for item in images]
    if not found:
        raise ConfigError(f"no records in data.paths={cfg.paths}" + (f" or data.dataset={cfg.dataset}" if cfg.dataset else ""))


def is_eval_document(name: str, eval_fraction: float) -> bool:
    bucket = int(hashlib.sha1(name.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    return bucket < eval_fraction


# =============================================================================================
# Rendering: the processor's chat template; the loss on the assistant's tokens only
# =============================================================================================


PER_TOKEN = ("mm_token_type_ids", "token_type_ids")
# The processor's outputs of the text; the rest are its image inputs (pixels, grids, sizes).
TEXT_OUTPUTS = ("input_ids", "attention_mask", "labels", "offset_mapping", "text_replacement_offsets", *PER_TOKEN)
# The image inputs a piece keeps (Qwen's grids, for its 3-D positions): a few numbers an image.
GRIDS = ("image_grid_thw", "video_grid_thw", "second_per_grid_ts")


def check_no_image_tokens(processor, messages: list, where: str) -> None:
    """Refuse a record whose text spells one of the image tokens (PaliGemma's ``<image>``): the
    processor would count it as an image and fail with no record named, or misplace the images."""
    spelled = [token for token in processor.tokenizer.convert_ids_to_tokens(sorted(image_token_ids(processor)))
               if isinstance(token, str) and token]
    for message in messages:
        for part in message["content"]:
            found = next((token for token in spelled if part["type"] == "text" and token in part["text"]), None)
            if found is not None:
                raise ConfigError(f"{where}: a text holds {found!r}, which this model's processor reads as an image "
                                  "token; remove it from the text (an image goes in an image part or LLaVA's "
                                  f"{PLACEHOLDER})")


def processor_inputs(processor, text: str, media: list, where: str = "a record", **kwargs) -> dict[str, Any]:
    """The processor's inputs of ``text`` and its ``media`` (pictures, ``ImageRef`` and ``VideoRef``,
    each kind in the order of its tokens); a video's frames as ``video_processor_of`` makes them."""
    images = [image_of(m) for m in media if not isinstance(m, VideoRef)]
    videos = [m for m in media if isinstance(m, VideoRef)]
    if videos:
        processor = video_processor_of(processor, where)
        temporal = getattr(processor.video_processor, "temporal_patch_size", 1) or 1
        opened = [video.open(temporal) for video in videos]
        kwargs = {**kwargs, "videos": [np.stack([np.asarray(f) for f in frames]) for frames, _ in opened],
                  "video_metadata": [metadata for _, metadata in opened], "do_sample_frames": False}
    out = processor(text=[text], images=[images] if images else None, return_tensors="pt", **kwargs)
    out.pop("video_metadata", None)
    return out


# Counting an example's tokens from its images' sizes, as their headers give them: no picture
# decoded, resized or normalised. transformers' processors know how many tokens an image of a
# size takes (``_get_num_multimodal_tokens``, the rule their own expansion follows); where the
# processor's expansion of an image is a run of that many image tokens between text that does
# not change, the ids are the processor's, made from the sizes alone. Checked against the
# processor itself on pictures of two sizes; a family whose expansion is otherwise (Idefics3's
# tiles, a processor without the rule) counts through the processor.
PROBE_SIZES = ((37, 53), (61, 23))  # (height, width)


def tokens_by_size(processor, sizes: list[tuple[int, int]]) -> list[int] | None:
    """The image tokens of each image of ``sizes`` by the processor's own rule, or None."""
    rule = getattr(processor, "_get_num_multimodal_tokens", None)
    try:
        counts = [int(n) for n in rule(image_sizes=[list(size) for size in sizes]).num_image_tokens] if rule else None
    except (AttributeError, KeyError, NotImplementedError, TypeError, ValueError):  # a rule this processor's settings do not carry
        return None
    return counts if counts is not None and len(counts) == len(sizes) else None


@dataclass(frozen=True)
class Expansion:
    """An image's placeholder as the processor expands it: ``before``, ``unit`` once per image
    token, ``after``."""

    before: str
    unit: str
    after: str

    def inputs(self, processor, text: str, sizes: list[tuple[int, int]]) -> dict[str, Any] | None:
        """The processor's text outputs (ids, offsets, its replacements) of ``text`` with images of
        ``sizes``, made from the sizes; None where the processor's rule gives no count."""
        counts = tokens_by_size(processor, sizes)
        if counts is None:
            return None
        replacements = [self.before + self.unit * n + self.after for n in counts]
        texts, replaced = processor.get_text_with_replacements([text], replacements)
        out = dict(processor.tokenizer(texts, return_offsets_mapping=True, return_tensors="pt"))
        return {**out, "text_replacement_offsets": replaced}


def expansion_form(processor, replacement: str, count: int) -> Expansion | None:
    """``replacement`` as ``before + unit * count + after``, ``unit`` a token the tokenizer adds."""
    for unit in sorted(token for token in processor.tokenizer.get_added_vocab() if token and token in replacement):
        found = re.fullmatch(f"(.*?)(?:{re.escape(unit)}){{{count}}}(.*)", replacement, re.S)
        if found and unit not in found.group(1) + found.group(2):
            return Expansion(found.group(1), unit, found.group(2))
    return None


def expansion_of(processor, images: int) -> Expansion | None:
    """The ``Expansion`` of this processor in texts of ``images`` images, where the ids it makes
    from sizes are those the processor makes of pictures of two sizes; else None."""
    from PIL import Image

    if prefix_suffix(processor) or not callable(getattr(processor, "get_text_with_replacements", None)):
        return None
    pictures = [Image.new("RGB", (width, height)) for height, width in PROBE_SIZES]
    text = render(processor, [user_turn(["a"], images), assistant_turn("b")])
    expansions = set()
    for shown in ([pictures[:1], pictures[1:]] if images == 1 else [pictures * (images // 2) + pictures[:images % 2]]):
        sizes = [p.size[::-1] for p in shown]
        counts = tokens_by_size(processor, sizes) or [-1] * len(sizes)
        made = processor_inputs(processor, text, shown, return_offsets_mapping=True, return_text_replacement_offsets=True)
        expansions |= {expansion_form(processor, r["replacement"], n) if n >= 0 else None
                       for r, n in zip(made["text_replacement_offsets"][0], counts)}
        expansion = next(iter(expansions))
        if len(expansions) != 1 or expansion is None:
            return None
        sized = expansion.inputs(processor, text, sizes)
        if sized is None or not all(torch.equal(torch.as_tensor(sized[key]), torch.as_tensor(made[key]))
                                    for key in ("input_ids", "offset_mapping")):
            return None
    return expansion


# The bytes of image inputs a run keeps from encoding, over its pieces (each rank its own): a
# run's images that fit are processed once; the pieces beyond are processed per batch.
KEPT_IMAGE_BYTES = 512 * 2**20


def image_inputs(processor, piece: dict[str, Any]) -> dict[str, torch.Tensor]:
    """A piece's image inputs (pixel values, ...): those ``encode`` made, where the piece keeps
    them (``keep_image_inputs``), else processed now from its image references by the call that
    encoded it: the same tensors either way."""
    if not piece["images"]:
        return {}
    if piece["inputs"] is not None:
        return piece["inputs"]
    out = processor_inputs(processor, piece["text"], piece["images"], **piece["call"])
    return {key: value for key, value in out.items() if key not in TEXT_OUTPUTS}


def piece_of(ids, targets, per_token, out, images: list, text: str, seq_len: int, **call) -> dict[str, Any]:
    """What a run keeps of an example: its tokens cut to ``seq_len + 1``, its image references
    and how the processor was asked (``text``, ``call``), its grids, and its image ``inputs`` as
    the processor made them (until ``keep_image_inputs`` drops them beyond its budget)."""
    return {"ids": ids[: seq_len + 1], "targets": targets[: seq_len + 1],
            "per_token": {key: value[: seq_len + 1] for key, value in per_token.items()},
            "grids": {key: value for key, value in out.items() if key in GRIDS},
            "inputs": {key: value for key, value in out.items() if key not in TEXT_OUTPUTS},
            "images": list(images), "text": text, "call": call, "truncated": len(ids) > seq_len + 1}


def keep_image_inputs(pieces: Iterator[dict[str, Any]], budget: int) -> list[dict[str, Any]]:
    """The pieces, each keeping its image inputs while they fit in ``budget`` bytes with those
    kept before it; the others drop theirs (``image_inputs`` makes them again per batch). Taken
    one piece at a time, so no more than the budget and one piece's are ever held."""
    kept, pieces_kept = 0, []
    for piece in pieces:
        size = sum(value.nbytes for value in piece["inputs"].values())
        if kept + size <= budget:
            kept += size
        else:
            piece = {**piece, "inputs": None}
        pieces_kept.append(piece)
    return pieces_kept


def encode(processor, messages: list, images: list, seq_len: int, where: str,
           expansion: Expansion | None = None) -> dict[str, Any]:
    """A piece: ``ids`` and ``targets`` (the token where the loss is over, ``IGNORE_INDEX``
    elsewhere) of the conversation as its chat template renders it, with the images' tokens
    expanded as the processor expands them, and the processor's image inputs (``keep_image_inputs``
    keeps them or not; else ``image_inputs`` makes them per batch). Cut to ``seq_len + 1``
    tokens; the images' tokens are never cut. With ``expansion``, the ids and targets alone,
    from the images' sizes (a piece to count, no image inputs)."""
    check_no_image_tokens(processor, messages, where)
    if prefix_suffix(processor):
        return encode_prefix_suffix(processor, messages, images, seq_len, where)
    text, spans = assistant_spans(processor, messages, where)
    sized = expansion is not None and bool(images) and not any(isinstance(i, VideoRef) for i in images)
    out = expansion.inputs(processor, text, [size_of(i) for i in images]) if sized else None
    if out is None:
        out = processor_inputs(processor, text, images, where, return_offsets_mapping=True,
                               return_text_replacement_offsets=True)
    ids = out.pop("input_ids")[0]
    offsets = out.pop("offset_mapping")[0].tolist()
    replaced = (out.pop("text_replacement_offsets", None) or [[]])[0]
    # Per-token inputs beside the ids (Qwen's mm_token_type_ids for its 3-D positions): cut and padded as they are.
    per_token = {key: out[key][0] for key in PER_TOKEN if key in out}
    # A span's characters move right by what each expansion before it added (``new_span`` is
    # where an expansion lies in the expanded text).
    ends = [r["span"][1] for r in replaced]
    gained = np.cumsum([0] + [(r["new_span"][1] - r["new_span"][0]) - (r["span"][1] - r["span"][0]) for r in replaced])
    moved = [tuple(int(c + gained[np.searchsorted(ends, c, side="right")]) for c in span) for span in spans]
    expansions = [tuple(r["new_span"]) for r in replaced]
    never = image_token_ids(processor)
    learnt = [
        end > start and any(a < end and start < b for a, b in moved) and not any(a <= start and end <= b for a, b in expansions)
        and token not in never
        for (start, end), token in zip(offsets, ids.tolist())
    ]
    image_positions = [i for i, ((start, end), token) in enumerate(zip(offsets, ids.tolist()))
                       if token in never or any(a <= start and end <= b and end > start for a, b in expansions)]
    if image_positions and len(image_positions) > seq_len:
        videos = sum(isinstance(m, VideoRef) for m in images)
        raise ConfigError(f"{where}: the images alone take {len(image_positions)} tokens, more than data.seq_len={seq_len}; "
                          "raise data.seq_len or give smaller images" if not videos else
                          f"{where}: the images and videos take {len(image_positions)} tokens (the videos "
                          f"{frames_of(out, processor)} frames), more than data.seq_len={seq_len}; raise data.seq_len, "
                          "lower data.video_max_frames or give smaller frames")
    if image_positions and image_positions[-1] > seq_len:
        raise ConfigError(f"{where}: the images' tokens end at token {image_positions[-1] + 1}, beyond data.seq_len={seq_len}; "
                          f"raise data.seq_len above {image_positions[-1] + 1} or shorten the text before the images")
    targets = torch.where(torch.tensor(learnt), ids, torch.full_like(ids, IGNORE_INDEX))
    return piece_of(ids, targets, per_token, out, images, text, seq_len)


def frames_of(out: dict[str, Any], processor) -> int:
    """The frames the videos of a processor's output hold: temporal patches times their frames."""
    grids = out.get("video_grid_thw")
    if grids is None or not len(grids):
        return 0
    temporal = getattr(getattr(processor, "image_processor", None), "temporal_patch_size", 1) or 1
    return int(torch.as_tensor(grids)[:, 0].sum()) * temporal


def prefix_and_suffix(messages: list, where: str) -> tuple[str, str]:
    """The user's text (the prefix) and the assistant's answer (the suffix) of a conversation of
    one user turn and one assistant turn: a prefix/suffix family has no turns beyond those."""
    roles = [m["role"] for m in messages]
    if roles not in (["user", "assistant"], ["user"]):
        raise ConfigError(f"{where}: turns {', '.join(roles)}; this model (prefix/suffix, no chat template, as "
                          "PaliGemma) takes one user turn (the prefix) and one assistant turn (the suffix)")
    texts = ["".join(p["text"] for p in m["content"] if p["type"] == "text") for m in messages]
    return texts[0], texts[1] if len(texts) > 1 else ""


def prefix_text(processor, messages: list, images: list) -> str:
    """The prefix as the processor expects it: an image token for each image, then the text."""
    return processor.image_token * len(images) + prefix_and_suffix(messages[:1], "the prompt")[0]


def encode_prefix_suffix(processor, messages: list, images: list, seq_len: int, where: str) -> dict[str, Any]:
    """A piece of a prefix/suffix family: the processor's own ``labels`` (the suffix's tokens and
    its end) are the targets; ``token_type_ids`` (prefix 0, suffix 1) go beside the ids."""
    if messages[-1]["role"] != "assistant":
        raise ConfigError(f"{where}: the conversation ends with no assistant turn: no suffix to learn")
    if not images:
        raise ConfigError(f"{where}: no image; this model (prefix/suffix, as PaliGemma) answers about an image")
    if any(isinstance(m, VideoRef) for m in images):
        video_processor_of(processor, where)  # refused: a prefix/suffix family takes images only
    suffix, prefix = prefix_and_suffix(messages, where)[1], prefix_text(processor, messages, images)
    out = processor_inputs(processor, prefix, images, suffix=[suffix])
    ids, targets = out["input_ids"][0], torch.as_tensor(out["labels"][0])
    per_token = {key: out[key][0] for key in PER_TOKEN if key in out}
    images_end = int((ids == processor.image_token_id).nonzero().max()) + 1
    if images_end > seq_len:
        raise ConfigError(f"{where}: the images' tokens end at token {images_end}, beyond data.seq_len={seq_len}; "
                          f"raise data.seq_len above {images_end} or give smaller images")
    return piece_of(ids, targets, per_token, out, images, prefix, seq_len, suffix=[suffix])


def loss_tokens(piece: dict[str, Any]) -> int:
    """The tokens the loss covers: targets after the first (the first token predicts nothing)."""
    return int((piece["targets"][1:] != IGNORE_INDEX).sum())


def prompt_of(messages: list) -> tuple[list, str]:
    """The conversation up to its last assistant turn, and that turn's text."""
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    answer = "".join(p["text"] for p in messages[last]["content"] if p["type"] == "text")
    return messages[:last], answer


def generation_inputs(processor, messages: list, images: list) -> dict[str, Any]:
    images_shown = sum(p["type"] in ("image", "video") for m in messages for p in m["content"])
    if prefix_suffix(processor):
        return dict(processor_inputs(processor, prefix_text(processor, messages, images[:images_shown]),
                                     images[:images_shown]))
    text = render(processor, messages, generation_prompt=True)
    return dict(processor_inputs(processor, text, images[:images_shown]))


def same_answer(said: str, expected: str) -> bool:
    """The answer says the expected words first (a family whose template ends no turn keeps talking)."""
    words = lambda s: re.findall(r"\w+", s.lower())  # noqa: E731
    want = words(expected)
    return bool(want) and words(said)[: len(want)] == want


# =============================================================================================
# The examples in the store: encoded once, mapped by every rank and later run
# =============================================================================================

# The examples of data files go in the token store (engine/token_store.py): a piece's ids and
# targets as its tokens; beside them (its record) what else a batch needs of it — per-token inputs,
# Qwen's grids and 3-D positions, the processor's text and call, its media references and a data
# set's image bytes — as one uncompressed .npz, read per piece by index. The built-in examples
# (generated) stay in memory. A store is keyed by the data files, the model folder's processing
# files and the settings that change a piece; the images and videos a store read are checked by
# their size and time at each opening, and a store whose media changed is built anew beside it.
MODEL_FOLDER_FILES = (".json", ".jinja", ".model", ".txt")  # the processor's, tokenizer's and model's settings


def processing_identity(model: ModelConfig) -> str:
    """What a store is keyed by for the model: its folder's settings files (processor, tokenizer,
    chat template, the config the 3-D positions follow) and transformers' version; not its weights."""
    import transformers

    folder = model_folder(model.pretrained_path)
    digest = hashlib.sha256(transformers.__version__.encode())
    for path in sorted(folder.iterdir()):
        if path.suffix in MODEL_FOLDER_FILES and path.is_file():
            digest.update(f"\0{path.name}\0".encode() + path.read_bytes())
    return digest.hexdigest()


def media_files(media: list) -> list[str]:
    """The files a piece's media are read from: an image's path, a video's file or frames."""
    files = []
    for item in media:
        if isinstance(item, VideoRef):
            files += [str(path) for path in item.frame_files()] or [item.path()]
        elif isinstance(item, ImageRef) and isinstance(item.value, str):
            files.append(str(item.base / item.value) if item.base is not None else item.value)
    return files


MEDIA_LIST = "media.jsonl"  # in a store: the media files its pieces read, one JSON string a line, in path order
MAX_MEDIA_LINE = 1 << 16  # a path (at most PATH_MAX, 4,096 bytes) as JSON escapes it, with room


def media_digest(files: Iterable[str]) -> str:
    """A digest of each file's path, size and modified time (-1 where it is gone), in the order
    given: what a store's media were when it was built, compared at each opening."""
    digest = hashlib.sha256()
    for path in files:
        try:
            status = os.stat(path)
            stats = [path, status.st_size, status.st_mtime_ns]
        except OSError:
            stats = [path, -1, -1]
        digest.update(json.dumps(stats).encode() + b"\n")
    return digest.hexdigest()


def stored_media(store: TokenStore) -> Iterator[str]:
    """The media files a store's pieces read, as its build listed them (:data:`MEDIA_LIST`), one
    at a time: a store of a million images holds their list on disk, not in its meta.json."""
    fd = os.open(store.folder / MEDIA_LIST, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with open(fd, encoding="utf-8") as listed:
        while line := listed.readline(MAX_MEDIA_LINE + 1):  # a run writes into the data cache: lines bounded
            if len(line) > MAX_MEDIA_LINE:
                raise ValueError(f"a line of {MEDIA_LIST} is longer than any path")
            yield json.loads(line)


def reference_fields(item) -> dict[str, Any]:
    """A medium's reference as JSON (an image given as bytes: its bytes go beside, :func:`piece_record`)."""
    base = str(item.base) if item.base is not None else None
    if isinstance(item, VideoRef):
        return {"video": item.value, "base": base, "where": item.where, "fps": item.fps, "max_frames": item.max_frames}
    return {"image": item.value if isinstance(item.value, str) else None, "base": base, "where": item.where,
            "size": list(item.size) if item.size is not None else None}


def image_bytes(value: Any) -> bytes:
    """An image a data set holds, as the bytes of a file: as given, or a picture saved as PNG (lossless)."""
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    buffer = io.BytesIO()
    value.save(buffer, format="PNG")
    return buffer.getvalue()


def piece_record(piece: dict[str, Any]) -> bytes:
    """What the store keeps beside a piece's tokens: its arrays and, as JSON, its text, call and media."""
    arrays = {f"per_token.{key}": np.asarray(value) for key, value in piece["per_token"].items()}
    arrays.update({f"grids.{key}": np.asarray(value) for key, value in piece["grids"].items()})
    if "positions" in piece:
        arrays["positions"] = piece["positions"].numpy()
    media = []
    for index, item in enumerate(piece["images"]):
        media.append(reference_fields(item))
        if isinstance(item, ImageRef) and not isinstance(item.value, str):
            arrays[f"image.{index}"] = np.frombuffer(image_bytes(item.value), dtype=np.uint8)
    header = {"text": piece["text"], "call": piece["call"], "truncated": piece["truncated"], "media": media}
    arrays["header"] = np.frombuffer(json.dumps(header).encode(), dtype=np.uint8)
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def stored_piece(tokens: np.ndarray, record: bytes) -> dict[str, Any]:
    """A piece as :func:`encode` made it (with its positions, without image inputs), from its
    tokens (ids, targets) and its record in the store."""
    with np.load(io.BytesIO(record), allow_pickle=False) as arrays:
        header = json.loads(arrays["header"].tobytes())
        named = {name: torch.from_numpy(arrays[name]) for name in arrays.files if name != "header"}
    media: list[Any] = []
    for index, fields in enumerate(header["media"]):
        base = Path(fields["base"]) if fields["base"] is not None else None
        if "video" in fields:
            media.append(VideoRef(fields["video"], base, fields["where"], fields["fps"], fields["max_frames"]))
        else:
            value = fields["image"] if fields["image"] is not None else named[f"image.{index}"].numpy().tobytes()
            media.append(ImageRef(value, base, fields["where"], tuple(fields["size"]) if fields["size"] else None))
    piece = {"ids": torch.from_numpy(tokens[0]), "targets": torch.from_numpy(tokens[1]),
             "per_token": {name.split(".", 1)[1]: v for name, v in named.items() if name.startswith("per_token.")},
             "grids": {name.split(".", 1)[1]: v for name, v in named.items() if name.startswith("grids.")},
             "inputs": None, "images": media, "text": header["text"], "call": header["call"],
             "truncated": header["truncated"]}
    return {**piece, "positions": named["positions"]} if "positions" in named else piece


class StoredPieces:
    """A split's pieces in the store, read by index from the mapping (the examples are never all
    in memory): ``pieces[i]`` is :func:`stored_piece`'s. With a processor and ``kept_bytes``, the
    image inputs of the pieces drawn are kept while they fit in that budget (each rank its own), so
    a run whose images fit processes each once; the others are made per batch (``image_inputs``)."""

    def __init__(self, store: TokenStore, split: str, processor=None, kept_bytes: int = 0):
        self.tokens, self.records, self.name = store.pieces(split), store.records(split), store.folder.name
        self.processor, self.budget = processor, kept_bytes
        self.kept: dict[int, dict[str, torch.Tensor]] = {}
        self.lock = threading.Lock()  # the prefetching thread draws pieces too

    def __len__(self) -> int:
        return len(self.tokens)

    def lengths(self) -> list[int]:
        """Each piece's inputs (its tokens less one), from the store's index alone: what packing fits."""
        return (np.diff(np.asarray(self.tokens.starts)) // 2 - 1).tolist()

    def __getitem__(self, index: int) -> dict[str, Any]:
        try:
            piece = stored_piece(self.tokens[index], self.records[index])
        except (ValueError, KeyError, TypeError, IndexError, MemoryError, OSError, zipfile.BadZipFile) as e:
            # A run writes into the data cache: a record planted there (not an .npz, arrays that
            # claim more than it holds, a header of other fields) is refused naming the store.
            raise ConfigError(f"the data cache's store {self.name}: piece {index}'s record is not one this template "
                              f"writes ({type(e).__name__}); remove the store (trainwright data-cache --remove "
                              f"{self.name}) and launch again") from None
        inputs = self.kept.get(index)
        if inputs is None and self.processor is not None and self.budget > 0 and piece["images"]:
            inputs = image_inputs(self.processor, piece)
            size = sum(value.nbytes for value in inputs.values())
            with self.lock:
                if size <= self.budget and index not in self.kept:
                    self.budget -= size
                    self.kept[index] = inputs
        return {**piece, "inputs": inputs}


def input_lengths(pieces) -> list[int]:
    """Each piece's inputs (its tokens less one): a store's from its index, else the pieces'."""
    return pieces.lengths() if isinstance(pieces, StoredPieces) else [len(p["ids"]) - 1 for p in pieces]


class PackedRows:
    """Rows of whole pieces (:func:`pack` of their inputs into ``capacity``): ``rows[i]`` is the
    pieces of row i, drawn from ``pieces`` as the row is."""

    def __init__(self, pieces, capacity: int):
        self.pieces, self.rows = pieces, pack(input_lengths(pieces), capacity)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> list[dict[str, Any]]:
        return [self.pieces[i] for i in self.rows[index]]


def new_counts(source: str) -> dict[str, Any]:
    """What a data summary counts: per split ``[examples, tokens, loss tokens]``, and the media."""
    return {"source": source, "train": [0, 0, 0], "eval": [0, 0, 0], "images": 0, "videos": 0, "frames": 0,
            "truncated": 0, "files": None, "formats": ""}


def count_piece(counts: dict[str, Any], piece: dict[str, Any], held_out: bool, processor) -> None:
    counted = counts["eval" if held_out else "train"]
    counted[0] += 1
    counted[1] += len(piece["ids"])
    counted[2] += loss_tokens(piece)
    videos = sum(isinstance(m, VideoRef) for m in piece["images"])
    counts["images"] += len(piece["images"]) - videos
    counts["videos"] += videos
    counts["frames"] += frames_of(piece["grids"], processor)
    counts["truncated"] += int(piece["truncated"])


def store_examples(writer, cfg: VLMChatDataConfig, processor, rope_index, listing: DataListing) -> dict[str, Any]:
    """Encode every record into the store's ``writer`` (one example in memory at a time), train and
    held-out apart; the counts, and the digest of the media read (:func:`media_digest`), which are
    listed beside the pieces (:data:`MEDIA_LIST`)."""
    counts, formats, files, media = new_counts("files"), [], set(), set()
    for where, messages, images in read_examples(cfg, formats):
        piece = with_positions(encode(processor, messages, images, cfg.seq_len, where), rope_index)
        held_out = is_eval_document(where, cfg.eval_fraction)
        tokens = torch.stack([piece["ids"], piece["targets"]]).numpy()
        writer.add("eval" if held_out else "train", tokens, piece_record(piece))
        count_piece(counts, piece, held_out, processor)
        files.add(where.rsplit(":", 1)[0])
        media.update(media_files(images))
        given = sum(len(i.value) for i in images if isinstance(i, ImageRef) and isinstance(i.value, bytes))
        writer.progress.advance(documents=1, bytes_read=text_size(messages) + given)
    if listing.changed():
        raise ConfigError("the data changed while it was encoded; launch again once it is written")
    listed = sorted(media)
    with writer.new_file(MEDIA_LIST) as file:
        file.writelines(json.dumps(path).encode() + b"\n" for path in listed)
    return {**counts, "files": len(files), "formats": ", ".join(formats), "media": media_digest(listed)}


UNBUILT = 1 << 62  # bytes over any limit: left_to_run then says whether the store is unbuilt, in the launch check


def example_store(config: VLMChatConfig, processor, listing: DataListing) -> TokenStore | None:
    """The examples of data files encoded once (:func:`store_examples`), in the store of the data's
    fingerprint, the model's processing and the settings that change a piece; built on first use,
    mapped by every rank and later run. A store whose images or videos changed since it was built
    is built anew under a key of their new stats (every rank finds the same). None in the launch
    check for data left to the run (:func:`engine.token_store.leave_to_run`), once the first
    records of each file encode and the disk has room for the store; data files whose size is
    under ``data.tokenize_in_check_mb`` but whose named images and videos are over it are left too."""
    cfg = config.data
    identity, size = data_identity(cfg.paths, FILE_SUFFIXES, listing, cfg.dataset)
    parts = dict(template="vlm_chat", data=identity, processing=processing_identity(config.model), seq_len=cfg.seq_len,
                 eval_fraction=cfg.eval_fraction, format=cfg.format, caption_prompt=cfg.caption_prompt,
                 subset=cfg.subset, split=cfg.split, video_fps=cfg.video_fps, video_max_frames=cfg.video_max_frames)

    def read_head(records: int) -> None:
        for where, messages, images in read_examples(cfg, head=records):
            encode(processor, messages, images, cfg.seq_len, where)

    def build(writer) -> dict[str, Any]:
        return store_examples(writer, cfg, processor, rope_index_of(model_on_meta(config.model)), listing)

    key = store_key(**parts)
    for _ in range(3):
        if leave_to_run(key, size, cfg.tokenize_in_check_mb, read_head):
            return None
        limit = cfg.tokenize_in_check_mb * 1e6
        if left_to_run(key, UNBUILT, cfg.tokenize_in_check_mb) and size + named_media_bytes(cfg, limit - size) > limit:
            read_head(HEAD_RECORDS)  # the data files are small, the images they name are not: as leave_to_run
            check_disk_space(size)
            return None
        store = open_or_build(key, rows=2, dtype="int32", build=build, input_bytes=size, records=True,
                              whole_size=not cfg.dataset)
        try:
            now: str | None = media_digest(stored_media(store))
        except (OSError, ValueError):  # its list gone, a link or not the builder's: as media that changed
            now = None
        if now == store.counts["media"]:
            return store
        key = store_key(**parts, media=now)
    raise ConfigError("the data's images or videos changed while they were encoded; launch again once they are written")


def builtin_counts(cfg: VLMChatDataConfig, processor) -> tuple[dict[str, Any], list[int]]:
    """The built-in examples' counts and their training pieces' inputs, their tokens counted from
    the images' sizes where the family allows (``expansion_of``)."""
    counts, lengths = {**new_counts("builtin"), "formats": "builtin"}, []
    expansion = expansion_of(processor, 1)
    for where, messages, pictures in builtin_examples(cfg.builtin_images, cfg.builtin_image_size):
        piece = encode(processor, messages, pictures, cfg.seq_len, where, expansion)
        held_out = is_eval_document(where, cfg.eval_fraction)
        if not held_out:
            lengths.append(len(piece["ids"]) - 1)
        count_piece(counts, piece, held_out, processor)
    return counts, lengths


def data_summary(config: VLMChatConfig, processor, counts: dict[str, Any], train_lengths: list[int],
                 **fields) -> DataSummary:
    """The data summary of the counts (:func:`new_counts`): exact, from the store or the built-in examples."""
    cfg, train, held_out = config.data, counts["train"], counts["eval"]
    if not train[0]:
        raise ConfigError(f"no training examples: data.eval_fraction={cfg.eval_fraction} holds out all of them")
    videos = counts["videos"]
    return DataSummary(
        source=counts["source"], paths=[*cfg.paths, *([cfg.dataset] if cfg.dataset else [])][:20],
        files=counts["files"], documents=train[0] + held_out[0], tokens=train[1] + held_out[1],
        train_documents=train[0], train_tokens=train[1], eval_documents=held_out[0], eval_tokens=held_out[1],
        tokenizer=f"{type(processor).__name__} of {config.model.pretrained_path}",
        format=f"{counts['formats']} ({counts['images']} images"
               + (f", {videos} videos of {counts['frames']} frames)" if videos else ")")
               + (f"; packed: {len(pack(train_lengths, cfg.seq_len))} rows of {cfg.seq_len}" if cfg.packing else ""),
        # engine.chat.assistant_spans (image tokens never); a prefix/suffix family's suffix: the completion
        mask="completion" if prefix_suffix(processor) else "turn_render",
        loss_tokens=train[2] + held_out[2], train_loss_tokens=train[2], eval_loss_tokens=held_out[2],
        truncated=counts["truncated"], **fields,
    )


# =============================================================================================
# Batches
# =============================================================================================


def rope_index_of(model: torch.nn.Module):
    """The family's 3-D rotary positions, ``get_rope_index`` of Qwen2-VL and its kin (text
    positions, each image's (t, h, w) grid, the text after an image moved past it), or None
    for a family whose positions are 0, 1, 2, ..."""
    return next((m.get_rope_index for m in model.modules() if hasattr(m, "get_rope_index")), None)


def with_positions(piece: dict[str, Any], rope_index) -> dict[str, Any]:
    """The piece with its 3-D positions over its inputs (all tokens but the last): computed
    once, where the model would compute them again for every batch (a Python loop over the
    tokens of each row: 14 ms of a 90 ms step of the tiny Qwen2-VL on one CPU thread)."""
    token_types = piece["per_token"].get("mm_token_type_ids")
    if rope_index is None or token_types is None:
        return piece
    positions, _ = rope_index(input_ids=piece["ids"][None, :-1], mm_token_type_ids=token_types[None, :-1],
                              **piece["grids"])
    return {**piece, "positions": positions[:, 0]}


def stack_images(values: list[torch.Tensor]) -> torch.Tensor:
    """The images' tensors of a batch along the first dimension, the others padded with zeros
    to the largest (Idefics3's tiles, OneVision's patches; a family drops all-zero images)."""
    if len({v.shape[1:] for v in values}) > 1:
        shape = [max(v.shape[d] for v in values) for d in range(1, values[0].dim())]
        values = [F.pad(v, [p for d in reversed(range(len(shape))) for p in (0, shape[d] - v.shape[d + 1])])
                  for v in values]
    return torch.cat(values)


def batch_images(processor, pieces: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """The batch's image inputs: each piece's, kept or processed now (``image_inputs``), in the
    pieces' order, stacked (``stack_images``)."""
    inputs = [image_inputs(processor, piece) for piece in pieces]
    return {key: stack_images([i[key] for i in inputs if key in i]) for key in {k for i in inputs for k in i}}


def collate(pieces: list[dict[str, Any]], processor) -> dict[str, torch.Tensor]:
    pad_id = processor.tokenizer.pad_token_id
    length = max(len(p["ids"]) for p in pieces) - 1
    input_ids = torch.full((len(pieces), length), pad_id, dtype=torch.int64)
    labels = torch.full((len(pieces), length), IGNORE_INDEX, dtype=torch.int64)
    attention_mask = torch.zeros((len(pieces), length), dtype=torch.int64)
    for row, piece in enumerate(pieces):
        n = len(piece["ids"]) - 1
        input_ids[row, :n] = piece["ids"][:-1]
        labels[row, :n] = piece["targets"][1:]
        attention_mask[row, :n] = 1
    batch = {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}
    for key in {k for p in pieces for k in p["per_token"]}:
        batch[key] = torch.zeros((len(pieces), length), dtype=torch.int64)
        for row, piece in enumerate(pieces):
            batch[key][row, : len(piece["ids"]) - 1] = piece["per_token"][key][:-1]
    if all("positions" in p for p in pieces):  # (3, batch, length), as the model computes them itself
        batch["position_ids"] = torch.zeros((len(pieces[0]["positions"]), len(pieces), length), dtype=torch.int64)
        for row, piece in enumerate(pieces):
            batch["position_ids"][:, row, : len(piece["ids"]) - 1] = piece["positions"]
    return {**batch, **batch_images(processor, pieces)}


def pack(lengths: list[int], capacity: int) -> list[list[int]]:
    """Rows of whole pieces, given each piece's inputs (its tokens less one): best-fit
    decreasing, the longest first, each into the fullest row with room for it. Indices."""
    rooms: list[tuple[int, int]] = []  # (room left, row), sorted
    rows: list[list[int]] = []
    for index in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        at = bisect.bisect_left(rooms, (lengths[index], -1))
        if at == len(rooms):
            rows.append([])
            room, row = capacity, len(rows) - 1
        else:
            room, row = rooms.pop(at)
        rows[row].append(index)
        if room > lengths[index]:
            bisect.insort(rooms, (room - lengths[index], row))
    return [sorted(row) for row in rows]


def collate_packed(rows: list[list[dict[str, Any]]], processor) -> dict[str, torch.Tensor]:
    """Packed rows: each row's pieces one after the other, then padding. Position ids restart
    at 0 with each piece (Qwen's: a row of these before its 3-D ones) and the padding is a
    sequence of its own; with no attention_mask, transformers keeps each piece's attention to
    its own tokens, so a piece's loss is the one it has alone. ``padding`` (no model input)
    marks the padding; the images go in the order of their tokens."""
    pieces, pad_id = [piece for row in rows for piece in row], processor.tokenizer.pad_token_id
    length = max(sum(len(p["ids"]) - 1 for p in row) for row in rows)
    input_ids = torch.full((len(rows), length), pad_id, dtype=torch.int64)
    labels = torch.full((len(rows), length), IGNORE_INDEX, dtype=torch.int64)
    positions = torch.zeros((len(rows), length), dtype=torch.int64)
    padding = torch.ones((len(rows), length), dtype=torch.bool)
    per_token = {key: torch.zeros((len(rows), length), dtype=torch.int64) for p in pieces for key in p["per_token"]}
    rope = torch.zeros((len(pieces[0]["positions"]), len(rows), length), dtype=torch.int64) \
        if all("positions" in p for p in pieces) else None
    for r, row in enumerate(rows):
        start = 0
        for piece in row:
            end = start + len(piece["ids"]) - 1
            input_ids[r, start:end], labels[r, start:end] = piece["ids"][:-1], piece["targets"][1:]
            positions[r, start:end] = torch.arange(end - start)
            for key, values in piece["per_token"].items():
                per_token[key][r, start:end] = values[:-1]
            if rope is not None:
                rope[:, r, start:end] = piece["positions"]
            start = end
        positions[r, start:] = torch.arange(length - start)
        padding[r, :start] = False
    batch = {"input_ids": input_ids, "labels": labels, "padding": padding, **per_token,
             "position_ids": positions if rope is None else torch.cat([positions[None], rope])}
    return {**batch, **batch_images(processor, pieces)}


class BatchStream(Stateful):
    """This rank's micro-batches, forever: each epoch visits the pieces (or, ``packed``, the rows
    of pieces) in a new seeded order. The position counts the global stream's sequences, so a
    checkpoint resumes on any number of processes with the very next batch. A batch's images that
    its pieces do not keep are processed as it is drawn (``collate``); with ``prefetch``, the
    next batch is made by a background thread while the model trains on this one (a batch
    depends on its position alone: the same batches either way)."""

    def __init__(self, pieces, processor, seed, micro_batch, dp_rank, dp_size, packed=False, prefetch=False):
        self.pieces, self.processor, self.seed, self.packed = pieces, processor, seed, packed
        self.micro_batch, self.dp_rank, self.dp_size = micro_batch, dp_rank, dp_size
        self.position = 0
        self._order: tuple[int, torch.Tensor] | None = None
        self._workers = ThreadPoolExecutor(1, thread_name_prefix="vlm-batches") if prefetch else None
        self._ahead: tuple[int, Future] | None = None  # (position, the batch there)

    def _piece_at(self, index: int):
        epoch, offset = divmod(index, len(self.pieces))
        order = self._order  # read once: the prefetching thread may replace it
        if order is None or order[0] != epoch:
            generator = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
            order = self._order = (epoch, torch.randperm(len(self.pieces), generator=generator))
        return self.pieces[int(order[1][offset])]

    def batch_at(self, position: int) -> dict[str, torch.Tensor]:
        start = position + self.dp_rank * self.micro_batch
        batch = [self._piece_at(i) for i in range(start, start + self.micro_batch)]
        return collate_packed(batch, self.processor) if self.packed else collate(batch, self.processor)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        ahead, self._ahead = self._ahead, None
        batch = ahead[1].result() if ahead is not None and ahead[0] == self.position else self.batch_at(self.position)
        self.position += self.micro_batch * self.dp_size
        if self._workers is not None:
            self._ahead = (self.position, self._workers.submit(self.batch_at, self.position))
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.position = int(state_dict["position"])


# =============================================================================================
# The recipe
# =============================================================================================


class VLMChat(Engine):
    """Vision-language chat: a Hub image-text-to-text model in its own chat format; the loss on
    the assistant's tokens only."""

    config_class = VLMChatConfig

    @cached_property
    def processor(self):
        return load_processor(self.config.model.pretrained_path)

    def prepare_model(self) -> torch.nn.Module:
        model = load_model(self.config.model)
        freeze_parts(model, self.config.model)
        model = model.to(self.device)
        return apply_fsdp(model, self.dist, self.config.parallel)

    def prepare_optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        optim = self.config.optim
        trainable = [p for p in model.parameters() if p.requires_grad]
        if not trainable:
            raise ConfigError("model.train_vision_tower, model.train_projector and model.train_language_model are all "
                              "false: nothing would train")
        return torch.optim.AdamW(trainable, lr=optim.lr, betas=(optim.beta1, optim.beta2), eps=optim.eps,
                                 weight_decay=optim.weight_decay, fused=True)

    def packing_hint(self) -> str | None:
        """This template packs by data.packing (the sequence-packing skill refuses it), for the families of PACKS."""
        if self.config.data.packing or family_of(model_folder(self.config.model.pretrained_path)) not in PACKS:
            return None
        return "data.packing=true fills each row with whole examples, each attending to itself (this template's key)"

    @cached_property
    def builtin(self) -> bool:
        """No data given: the generated examples, kept in memory."""
        return not self.config.data.paths and not self.config.data.dataset

    @cached_property
    def examples(self) -> tuple[list, list]:
        """(train, held out): ``(where, messages, images)``, the images as ``ImageRef``. The
        built-in examples all; of data files (in the store, ``self.store``) no training example
        and the first ``data.eval_prompts`` held-out ones, read until found."""
        cfg, train, held_out = self.config.data, [], []
        if not self.builtin:
            if not cfg.eval_fraction:  # none held out: the records are not read through for one
                return [], []
            held = (e for e in read_examples(cfg) if is_eval_document(e[0], cfg.eval_fraction))
            return [], list(islice(held, cfg.eval_prompts))
        for example in load_examples(cfg)[0]:
            (held_out if is_eval_document(example[0], cfg.eval_fraction) else train).append(example)
        return train, held_out

    @cached_property
    def store(self) -> TokenStore:
        """The examples of data files, encoded and mapped (built by the launch check, or now when it was not)."""
        store = example_store(self.config, self.processor, self.data_listing)
        assert store is not None  # outside the launch check a store is always built
        return store

    def pieces(self, examples, kept_bytes: int = 0) -> list[dict[str, Any]]:
        """The examples encoded, keeping up to ``kept_bytes`` of their image inputs."""
        rope_index = rope_index_of(self.model if hasattr(self, "model") else model_on_meta(self.config.model))
        return keep_image_inputs((with_positions(encode(self.processor, messages, images, self.config.data.seq_len, where),
                                                 rope_index) for where, messages, images in examples), kept_bytes)

    def split_pieces(self, split: str, kept_bytes: int = 0):
        """A split's pieces: the built-in examples encoded now, or the store's (``StoredPieces``)."""
        if self.builtin:
            return self.pieces(self.examples[split == "eval"], kept_bytes)
        return StoredPieces(self.store, split, self.processor, kept_bytes)

    @classmethod
    def summarize_data(cls, config: VLMChatConfig) -> DataSummary:
        cfg = config.data
        check_packing(config)
        processor = load_processor(config.model.pretrained_path)
        if not cfg.paths and not cfg.dataset:
            return data_summary(config, processor, *builtin_counts(cfg, processor))
        listing = DataListing()
        store = example_store(config, processor, listing)
        if store is None:  # the run encodes it as its first phase
            return DataSummary.left_to_run("files", [*cfg.paths, *([cfg.dataset] if cfg.dataset else [])],
                                           len(listing.files), sum(path.stat().st_size for path in listing.files),
                                           tokenizer=f"{type(processor).__name__} of {config.model.pretrained_path}",
                                           **listing.summary_fields())
        return data_summary(config, processor, store.counts, StoredPieces(store, "train").lengths(),
                            **listing.summary_fields())

    def stream(self, split: str, seed: int, prefetch: bool = False, kept_bytes: int = 0) -> BatchStream:
        pieces, cfg = self.split_pieces(split, kept_bytes), self.config.data
        if cfg.packing:
            pieces = PackedRows(pieces, cfg.seq_len)
        return BatchStream(pieces, self.processor, seed=seed, micro_batch=self.micro_batch_size,
                           dp_rank=self.dist.dp_rank, dp_size=self.dist.dp_size, packed=cfg.packing, prefetch=prefetch)

    def prepare_data(self) -> BatchStream:
        check_packing(self.config)
        if not (self.examples[0] if self.builtin else self.store.counts["train"][0]):
            raise ConfigError(f"no training examples: data.eval_fraction={self.config.data.eval_fraction} "
                              "holds out all of them")
        return self.stream("train", self.config.train.seed, prefetch=True, kept_bytes=KEPT_IMAGE_BYTES)

    def prepare_eval_data(self) -> list[dict[str, torch.Tensor]] | None:
        if not self.config.train.eval_every or not (self.examples[1] if self.builtin else self.store.counts["eval"][0]):
            return None
        stream = self.stream("eval", seed=0)
        return [next(stream) for _ in range(self.config.train.eval_batches)]

    def compute_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        inputs = {key: value for key, value in batch.items() if key not in ("labels", "padding")}
        learnt = batch["labels"] != IGNORE_INDEX
        with logits_only_at(self.model, learnt):
            logits = self.model(**inputs, use_cache=False).logits
        if logits.dim() == 3:  # the head saw every position
            logits = logits[learnt]
        return F.cross_entropy(logits.float(), batch["labels"][learnt], reduction="sum")

    def count_padding(self, batch: dict[str, torch.Tensor]) -> int:
        return int(batch["padding"].sum()) if "padding" in batch else int((batch["attention_mask"] == 0).sum())

    def flops_per_token(self) -> float:
        text = self.model.config.get_text_config()
        return transformer_flops_per_token(non_embedding_params(self.model), text.num_hidden_layers,
                                           text.hidden_size, self.config.data.seq_len)

    def evaluate(self) -> float:
        """The eval loss; during training ``answer_accuracy`` is logged beside it (``evaluate``
        of ``engine.model_io`` asks ``task_metrics()`` for it itself)."""
        loss = super().evaluate()
        if "optimizer" in vars(self):
            self.logger.log({"step": self.state.step, **self.task_metrics()})
        return loss

    # Looking at the model: export, sample, evaluate ------------------------------------------

    def hf_processing(self):
        return self.processor

    def sample_inputs(self, index: int, prompt: str, image: str | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
        """``sample``: prompt ``i`` is asked of ``image`` (a file in the workspace), or else of
        held-out image ``i``, in the model's chat format, as the user's turn; ``expected`` is the
        answer the data holds to its own question."""
        question = [user_turn([prompt], 1)]
        if image is not None:
            inputs = generation_inputs(self.processor, question, [read_image(image, None, f"image {image}")])
            inputs.pop("attention_mask", None)  # sample gives its own
            return inputs, {"input": f"image {image}"}
        held_out = self.examples[1]
        if not held_out:
            raise ConfigError("no examples are held out (data.eval_fraction=0): give sample an image per prompt")
        where, messages, images = held_out[index % len(held_out)]
        answer = prompt_of(messages)[1]
        kind = "video" if images and isinstance(images[0], VideoRef) else "image"  # asked of its first
        question = [{"role": "user", "content": [{"type": kind}, {"type": "text", "text": prompt}]}]
        inputs = generation_inputs(self.processor, question, images[:1])
        inputs.pop("attention_mask", None)  # sample gives its own
        return inputs, {"input": f"held-out {kind}(s) of {where}", "expected": answer[:1000]}

    @torch.no_grad()
    def answers(self, examples, max_new_tokens: int = 16) -> list[str]:
        tokenizer = self.processor.tokenizer
        device = next(self.model.parameters()).device
        said = []
        for _, messages, images in examples:
            inputs = generation_inputs(self.processor, prompt_of(messages)[0], images)
            inputs = {key: value.to(device) for key, value in inputs.items()}
            output = self.model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
            said.append(tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))
        return said

    def task_metrics(self) -> dict[str, float]:
        """``answer_accuracy``: the share of held-out questions whose greedy answer (through the
        chat template) says the expected answer's words first; ``answered`` counts them."""
        held_out = self.examples[1][: self.config.data.eval_prompts]
        if not held_out:
            return {}
        was_training = self.model.training
        self.model.eval()
        said = self.answers(held_out)
        self.model.train(was_training)
        right = sum(same_answer(s, prompt_of(m)[1]) for s, (_, m, _) in zip(said, held_out))
        return {"answer_accuracy": right / len(held_out), "answered": float(len(held_out))}
