"""Vision-language model (LLaVA-style): a small model learns to caption images.

Read it top to bottom: configuration, the processor (byte tokenizer + image processor), the
built-in generated image-caption set, data, model, then the recipe class. It runs as it is
(``trainwright run recipes/<name>``): a tiny ``LlavaForConditionalGeneration`` (a SigLIP
vision tower, a projector, the Llama model of ``causal_lm``) learns to say which shape, colour
and position a rendered image shows, on a laptop CPU in minutes, and ``task_metrics()`` checks
its greedy captions of held-out images.

Supports:
- ``.jsonl`` files of ``{"image": "relative/path.png", "caption": "..."}`` (paths relative to the
  ``.jsonl`` file, read with PIL, confined to the workspace) or the generated set, read once into
  a store every rank and later run maps (``engine/token_store.py``: the captions' tokens, each
  image beside them as resized uint8; large data as the run's first phase)
- training stages: ``model.stage=align`` (only the projector trains) and ``model.stage=finetune``
  (projector and language model); the vision tower trains only with ``model.train_vision_tower``
- starting from an exported run of this template (``model.pretrained_path``): a finetune stage
  after an align stage; or from a ``causal_lm``/``sft`` export as the language model
  (``model.language_model_path``), which the align stage then teaches to see
- everything the engine does: FSDP2 over N processes, checkpoints resumable bit for bit,
  gradient accumulation and clipping, periodic evaluation (with ``caption_accuracy``)
"""

from __future__ import annotations

import hashlib
import json
import warnings
from functools import cached_property
from pathlib import Path
from typing import Any, Iterator, Literal

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field, model_validator
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from torch.distributed.checkpoint.stateful import Stateful
from transformers import (
    AutoModelForCausalLM,
    AutoProcessor,
    LlamaConfig,
    LlamaForCausalLM,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaProcessor,
    PreTrainedTokenizerFast,
    SiglipVisionConfig,
)
from transformers.convert_slow_tokenizer import bytes_to_unicode
from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

from engine.config import ConfigError, EngineConfig, Section
from engine.data_files import (
    DataListing, DataPathRefused, confined_path, data_file, data_files, jsonl_records, open_data_file,
)
from engine.engine import IGNORE_INDEX, Engine
from engine.flops import non_embedding_params, transformer_flops_per_token
from engine.fsdp import apply_fsdp
from engine.optimizers import adamw_8bit
from engine.data_summary import split_counts
from engine.run_dir import DataSummary
from engine.token_store import (
    DISK_BYTES_PER_INPUT_BYTE,
    StoredDataConfig,
    TokenStore,
    check_disk_space,
    leave_to_run,
    open_or_build,
    store_key,
    tokenizer_identity,
)

# =============================================================================================
# Configuration
# =============================================================================================


class ModelConfig(Section):
    stage: Literal["align", "finetune"] = Field(
        "finetune", description="align: only the projector trains; finetune: the language model too."
    )
    train_vision_tower: bool = Field(False, description="The vision tower trains too.")
    hidden_size: int = Field(128, ge=8, description="Model width.")
    intermediate_size: int = Field(344, ge=8, description="MLP width.")
    num_layers: int = Field(2, ge=1, description="Decoder layers.")
    num_heads: int = Field(4, ge=1, description="Attention heads.")
    num_kv_heads: int = Field(2, ge=1, description="Key/value heads (GQA).")
    vision_hidden_size: int = Field(64, ge=8, description="Width of the vision tower built.")
    vision_layers: int = Field(2, ge=1, description="Layers of the vision tower built.")
    patch_size: int = Field(8, ge=1, description="(image_size/patch_size)² image tokens.")
    attn_implementation: Literal["sdpa", "eager"] = Field(
        "sdpa", description="Attention kernel."
    )
    pretrained_path: str | None = Field(None, description="An exported run of this template to start from.")
    language_model_path: str | None = Field(None, description="A causal_lm or sft export as the language model.")


class VLMDataConfig(StoredDataConfig):
    seq_len: int = Field(64, ge=2, description="Tokens per sequence (image tokens included).")
    source: Literal["builtin", "files"] | None = Field(
        None, description="builtin: generated shapes; files: data.paths (default when set)."
    )
    paths: list[str] = Field(default_factory=list, description='.jsonl of {"image", "caption"}, or folders.')
    image_size: int = Field(32, ge=8, description="Images are resized to this side.")
    eval_fraction: float = Field(0.05, ge=0, le=1, description="Images held out (1: all, for `trainwright evaluate`).")
    builtin_images: int = Field(4000, ge=10, description="data.source=builtin: how many images.")
    eval_prompts: int = Field(100, ge=1, description="Held-out images task_metrics() captions.")

    @model_validator(mode="after")
    def _source_matches_paths(self) -> "VLMDataConfig":
        if self.source is None:
            object.__setattr__(self, "source", "files" if self.paths else "builtin")
        elif self.paths and self.source != "files":
            raise ValueError(f"data.paths is set but data.source={self.source} would ignore it; drop data.source")
        elif self.source == "files" and not self.paths:
            raise ValueError("data.source=files needs data.paths (.jsonl files, relative to the workspace)")
        return self


class VLMConfig(EngineConfig):
    model: ModelConfig = ModelConfig()
    data: VLMDataConfig = VLMDataConfig()

    @model_validator(mode="after")
    def _image_fits(self) -> "VLMConfig":
        if self.model.pretrained_path and self.model.language_model_path:
            raise ValueError("model.pretrained_path already holds a language model; drop model.language_model_path")
        if self.data.image_size % self.model.patch_size:
            raise ValueError(
                f"data.image_size={self.data.image_size} is not a multiple of model.patch_size={self.model.patch_size}"
            )
        tokens = (self.data.image_size // self.model.patch_size) ** 2
        if self.data.seq_len < tokens + 2:
            raise ValueError(f"data.seq_len={self.data.seq_len} leaves no room for a caption after the "
                             f"{tokens} image tokens; raise it above {tokens + 2}")
        return self


# =============================================================================================
# Processor: a byte tokenizer with an <image> token, and an image processor
# =============================================================================================

IMAGE_TOKEN = "<image>"
# SiglipImageProcessor's own normalisation: pixels / 255, then (x - 0.5) / 0.5.
IMAGE_MEAN = IMAGE_STD = (0.5, 0.5, 0.5)
RESAMPLE = 3  # PIL's bicubic, SiglipImageProcessor's default: images from files are resized with it once


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """Bytes are tokens 0-255, end of caption 256, padding 257 (the ids of ``causal_lm``'s and
    ``sft``'s byte tokenizer) and ``<image>`` 258."""
    byte_to_char = bytes_to_unicode()
    tokenizer = Tokenizer(models.BPE(vocab={byte_to_char[b]: b for b in range(256)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="</s>", pad_token="<pad>")
    tokenizer.add_tokens([IMAGE_TOKEN], special_tokens=True)
    return tokenizer


def build_processor(image_size: int, patch_size: int) -> LlavaProcessor:
    """What ``export`` saves beside the weights, so ``AutoProcessor.from_pretrained`` turns an
    image and a text with ``<image>`` into the model's inputs."""
    image_processor = SiglipImageProcessorPil(
        size={"height": image_size, "width": image_size}, image_mean=IMAGE_MEAN, image_std=IMAGE_STD,
        resample=RESAMPLE,
    )
    return LlavaProcessor(
        image_processor=image_processor, tokenizer=byte_tokenizer(), patch_size=patch_size,
        vision_feature_select_strategy="full", image_token=IMAGE_TOKEN,
    )


def load_processor(cfg: VLMConfig) -> LlavaProcessor:
    """The processor of ``model.pretrained_path`` when it has one, else a new one."""
    if cfg.model.pretrained_path:
        folder = Path(confined_path(cfg.model.pretrained_path))
        if not (folder / "processor_config.json").is_file():
            raise ConfigError(f"model.pretrained_path={cfg.model.pretrained_path} has no processor_config.json; "
                              "give a folder exported from a run of this template")
        processor = AutoProcessor.from_pretrained(folder)
        size = processor.image_processor.size["height"]
        if (size, processor.patch_size) != (cfg.data.image_size, cfg.model.patch_size):
            raise ConfigError(f"model.pretrained_path takes {size}-pixel images in patches of {processor.patch_size}; "
                              f"set data.image_size={size} and model.patch_size={processor.patch_size}")
        return processor
    return build_processor(cfg.data.image_size, cfg.model.patch_size)


def image_tokens(processor: LlavaProcessor) -> int:
    return (processor.image_processor.size["height"] // processor.patch_size) ** 2


def pixel_values(processor: LlavaProcessor, images: list) -> torch.Tensor:
    """``N × 3 × H × W`` model inputs of images (``H × W × 3`` uint8 arrays or PIL images)."""
    return processor.image_processor(images, return_tensors="pt")["pixel_values"]


# =============================================================================================
# The built-in image-caption set: rendered shapes whose captions can be checked
# =============================================================================================

SHAPES = ("circle", "square", "triangle")
COLOURS = {"red": (220, 40, 40), "green": (40, 200, 60), "blue": (50, 80, 230), "yellow": (230, 210, 40)}
POSITIONS = {"left": (0.3, 0.5), "right": (0.7, 0.5), "top": (0.5, 0.3), "bottom": (0.5, 0.7)}
ATTRIBUTES = {"shape": SHAPES, "colour": tuple(COLOURS), "position": tuple(POSITIONS)}
CHANCE = 1 / (len(SHAPES) * len(COLOURS) * len(POSITIONS))  # guessing all three words right


def caption(shape: str, colour: str, position: str) -> str:
    return f"a {colour} {shape} at the {position}"


def render(shape: str, colour: str, position: str, size: int, rng: np.random.Generator) -> np.ndarray:
    """A ``size × size × 3`` uint8 image: a shape on a noisy dark background, jittered in place,
    size and shade."""
    y, x = np.mgrid[0:size, 0:size] + 0.5
    cx, cy = (np.array(POSITIONS[position]) + rng.uniform(-0.04, 0.04, 2)) * size
    r = size * rng.uniform(0.2, 0.25)
    if shape == "circle":
        inside = (x - cx) ** 2 + (y - cy) ** 2 <= r**2
    elif shape == "square":
        inside = (np.abs(x - cx) <= r) & (np.abs(y - cy) <= r)
    else:  # pointing up: as wide at its base as it is tall
        inside = (y >= cy - r) & (y <= cy + r) & (np.abs(x - cx) <= (y - (cy - r)) / 2)
    image = rng.integers(0, 40, (size, size, 3)).astype(np.float64)
    shade = np.array(COLOURS[colour]) * rng.uniform(0.8, 1.1)
    image[inside] = shade
    return np.clip(image, 0, 255).astype(np.uint8)


def builtin_examples(count: int, size: int, seed: int = 0) -> list[tuple[str, np.ndarray, str]]:
    """``(name, image, caption)``: the same ones for the same arguments."""
    examples = []
    for i in range(count):
        rng = np.random.default_rng([seed, i])
        shape, colour, position = (values[rng.integers(len(values))] for values in ATTRIBUTES.values())
        examples.append((f"builtin-{i}", render(shape, colour, position, size, rng), caption(shape, colour, position)))
    return examples


def attributes(text: str) -> dict[str, set[str]]:
    """The attribute words a caption uses, per attribute."""
    words = set(text.replace(",", " ").replace(".", " ").split())
    return {name: words & set(values) for name, values in ATTRIBUTES.items()}


# =============================================================================================
# Data: (image, caption) → (tokens and targets, pixel values) pieces → padded batches
# =============================================================================================


def image_records(cfg: VLMDataConfig, listing: DataListing | None = None,
                  head: int | None = None) -> Iterator[tuple[str, str, Path, str]]:
    """``(where, image as the record names it, the .jsonl's folder, caption)`` of each record of
    data.paths (the first ``head`` of each file); the files are listed into ``listing``, their
    images not. A record without an image path or a caption is refused, naming its line."""
    for path, name in data_files(cfg.paths, suffixes={".jsonl"}, listing=listing):
        for number, (where, record) in enumerate(jsonl_records(path, name)):  # bad JSON, UTF-8 or surrogates: refused there
            if head is not None and number >= head:
                break
            if not isinstance(record.get("image"), str) or not isinstance(record.get("caption"), str):
                raise ConfigError(f'{where}: a record is {{"image": "relative/path.png", "caption": "..."}}')
            if not record["caption"].strip():
                raise ConfigError(f"{where}: the caption is empty")
            yield where, record["image"], path.parent, record["caption"]


def image_file(where: str, image: str, folder: Path, listing: DataListing | None) -> Path:
    """A record's image file: confined, a regular file, fingerprinted into ``listing``."""
    try:
        return data_file(str(folder / image), listing=listing)
    except DataPathRefused:
        raise
    except OSError as e:
        raise ConfigError(f"{where}: image {image!r} cannot be read ({e})") from None


def read_image(where: str, image: str, folder: Path, size: int, listing: DataListing | None = None):
    """A record's image, RGB, resized once to ``size`` (the processor's resize is then a no-op:
    100k photos of 512 × 512 would otherwise be decoded at full size per batch)."""
    from PIL import Image

    try:  # a data file: confined, a regular file, and part of the data fingerprint
        # PIL only warns between MAX_IMAGE_PIXELS and twice it (where it refuses): a PNG
        # of a few KB there decodes to hundreds of MB. Refused unread, as over twice it.
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with open_data_file(str(folder / image), listing=listing) as file, Image.open(file) as opened:
                return opened.convert("RGB").resize((size, size), RESAMPLE)
    except DataPathRefused:
        raise
    except (OSError, ValueError, Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise ConfigError(f"{where}: image {image!r} cannot be read ({e})") from None


def iter_examples(cfg: VLMDataConfig, listing: DataListing | None = None) -> Iterator[tuple[str, Any, str]]:
    """``(name, image, caption)``, one image decoded at a time; the name decides the train/eval
    split, so it must be stable. The records' files and their images are fingerprinted into ``listing``."""
    if cfg.source == "builtin":
        yield from builtin_examples(cfg.builtin_images, cfg.image_size)
        return
    found = False
    for where, image, folder, text in image_records(cfg, listing):
        found = True
        yield where, read_image(where, image, folder, cfg.image_size, listing), text
    if not found:
        raise ConfigError(NO_RECORDS.format(paths=cfg.paths))


def load_examples(cfg: VLMDataConfig, listing: DataListing | None = None) -> list[tuple[str, Any, str]]:
    """Every example of :func:`iter_examples` in memory (the run reads them from its store instead)."""
    return list(iter_examples(cfg, listing))


NO_RECORDS = "no image-caption records in data.paths={paths} (.jsonl files, one per line)"


def is_eval_document(name: str, eval_fraction: float) -> bool:
    bucket = int(hashlib.sha1(name.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    return bucket < eval_fraction


def caption_tokens(tokenizer, text: str) -> list[int]:
    """What the model learns to say: the caption's tokens and the end of caption. A caption is
    text: ``<image>`` in it is its bytes, never an image token the splice has no features for."""
    return text_tokens(tokenizer, text) + [tokenizer.eos_token_id]


def text_tokens(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)


def caption_piece(processor: LlavaProcessor, text: str, seq_len: int) -> torch.Tensor:
    """An example's ``2 × n`` tokens and targets: the ``<image>`` placeholder expanded to the
    model's image-token count, then the caption; targets are the caption's tokens,
    ``IGNORE_INDEX`` elsewhere. Cut to ``seq_len + 1`` tokens."""
    prompt = [processor.image_token_id] * image_tokens(processor)
    answer = caption_tokens(processor.tokenizer, text)
    tokens = torch.tensor(prompt + answer, dtype=torch.int64)
    targets = torch.tensor([IGNORE_INDEX] * len(prompt) + answer, dtype=torch.int64)
    return torch.stack([tokens, targets])[:, : seq_len + 1]


def make_pieces(examples, processor: LlavaProcessor, seq_len: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each example as ``(2 × n tokens and targets, 3 × H × W pixel values)`` (:func:`caption_piece`),
    all in memory; a run reads them from its store (:class:`StoredExamples`)."""
    pixels = pixel_values(processor, [image for _, image, _ in examples])
    return [(caption_piece(processor, text, seq_len), values) for (_, _, text), values in zip(examples, pixels)]


# The store of a run's examples (engine/token_store.py): each piece's tokens and targets, and beside
# it its record: the image as resized (image_size² × 3 uint8 bytes), then {"name", "caption"} as JSON.


class StoredExamples:
    """A split of the store, read by index from the mapping (the corpus is never held in memory):
    ``examples[i]`` is the piece :func:`make_pieces` makes, ``(tokens and targets, pixel values)``,
    its pixel values made by the processor from the stored image; ``image(i)`` and ``about(i)``
    (name, caption) for captions and samples."""

    def __init__(self, store: TokenStore, split: str, processor: LlavaProcessor):
        self.pieces, self.records, self.processor = store.pieces(split, torch.from_numpy), store.records(split), processor
        self.side = processor.image_processor.size["height"]

    def __len__(self) -> int:
        return len(self.pieces)

    def image(self, index: int) -> np.ndarray:
        return np.frombuffer(self.records[index][: 3 * self.side**2], dtype=np.uint8).reshape(self.side, self.side, 3)

    def about(self, index: int) -> tuple[str, str]:
        about = json.loads(self.records[index][3 * self.side**2 :].decode("utf-8", "surrogatepass"))
        return about["name"], about["caption"]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.pieces[index], pixel_values(self.processor, [self.image(index)])[0]


def example_store(cfg: VLMDataConfig, processor: LlavaProcessor, listing: DataListing) -> TokenStore | None:
    """Every example encoded once (:func:`caption_piece`, its resized image beside it), train and
    held-out apart, with the data summary's counts, in the store of the data's fingerprint (the
    records' files and their images), the tokenizer, the image size and token count and the
    settings that change pieces; built on first use (one image in memory at a time), mapped by
    every rank and later run. A file that changes while it is read fails the build, which keeps
    nothing. None in the launch check for data left to the run (:func:`engine.token_store.leave_to_run`),
    once the first records of each file are read and the disk has room for the store."""
    records = cfg.builtin_images
    if cfg.source == "builtin":
        identity, size = ["builtin", cfg.builtin_images], 0
    else:
        records = 0
        for where, image, folder, _ in image_records(cfg, listing):
            image_file(where, image, folder, listing)
            records += 1
        if not records:
            raise ConfigError(NO_RECORDS.format(paths=cfg.paths))
        identity, size = [listing.fingerprint()], sum(path.stat().st_size for path in listing.files)
    key = store_key(template="vlm", layout="image bytes + name and caption", data=identity,
                    tokenizer=tokenizer_identity(processor.tokenizer), image_token=processor.image_token_id,
                    image_tokens=image_tokens(processor), image_size=cfg.image_size, resample=RESAMPLE,
                    seq_len=cfg.seq_len, eval_fraction=cfg.eval_fraction)
    stored_bytes = records * (3 * cfg.image_size**2 + 8 * (cfg.seq_len + 1) + 256)  # + the caption's JSON, about

    def read_head(head: int) -> None:
        for where, image, folder, text in image_records(cfg, DataListing(hashing=False), head=head):  # hashed just now
            read_image(where, image, folder, cfg.image_size)
            caption_piece(processor, text, cfg.seq_len)
        check_disk_space(stored_bytes // DISK_BYTES_PER_INPUT_BYTE)

    if leave_to_run(key, size, cfg.tokenize_in_check_mb, read_head):
        return None

    def build(store) -> dict[str, Any]:
        check_disk_space(stored_bytes // DISK_BYTES_PER_INPUT_BYTE)  # images take more than their files
        counts = {True: [0, 0, 0], False: [0, 0, 0]}  # held out? -> [images, tokens, loss tokens]
        read, names = DataListing(), set()
        for name, image, text in iter_examples(cfg, read):
            piece = caption_piece(processor, text, cfg.seq_len)
            held_out = is_eval_document(name, cfg.eval_fraction)
            about = json.dumps({"name": name, "caption": text}).encode("utf-8", "surrogatepass")
            store.add("eval" if held_out else "train", piece.numpy(), np.asarray(image, dtype=np.uint8).tobytes() + about)
            store.progress.advance(documents=1, bytes_read=3 * cfg.image_size**2 + len(about))
            counted = counts[held_out]
            counted[0] += 1
            counted[1] += len(caption_tokens(processor.tokenizer, text))  # the caption's (image tokens are not text)
            counted[2] += int((piece[1, 1:] != IGNORE_INDEX).sum())  # what the loss is over: those cut to data.seq_len
            names.add(name.split(":", 1)[0])
        if read.fingerprint() != listing.fingerprint() or read.changed():
            raise ConfigError("the data changed while it was read; launch again once it is written")
        return dict(files=len(names) if cfg.source == "files" else None, **split_counts(counts))

    return open_or_build(key, rows=2, dtype="int32", build=build, input_bytes=size, records=True)


def collate(pieces, seq_len: int, pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad pieces to the longest of the batch (at most ``seq_len``): the input is a piece's
    tokens, the label at each position the next token's target (so only captions are learnt)."""
    seq_len = min(seq_len, max(tokens.shape[-1] - 1 for tokens, _ in pieces))
    input_ids = torch.full((len(pieces), seq_len), pad_id, dtype=torch.int64)
    labels = torch.full((len(pieces), seq_len), IGNORE_INDEX, dtype=torch.int64)
    for row, (tokens, _) in enumerate(pieces):
        n = tokens.shape[-1] - 1
        input_ids[row, :n] = tokens[0, :-1]
        labels[row, :n] = tokens[1, 1:]
    position_ids = torch.arange(seq_len).expand(len(pieces), seq_len).clone()
    pixels = torch.stack([values for _, values in pieces])
    return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids, "pixel_values": pixels}


class BatchStream(Stateful):
    """This rank's micro-batches, forever: each epoch visits the pieces in a new seeded order.

    The data position counts the sequences of the *global* batch stream consumed so far, so a
    checkpoint resumes with the very next batch on any number of processes.
    """

    def __init__(self, pieces, seq_len, pad_id, seed, micro_batch, dp_rank, dp_size):
        self.pieces, self.seq_len, self.pad_id, self.seed = pieces, seq_len, pad_id, seed
        self.micro_batch = micro_batch
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.position = 0  # global sequences consumed
        self._order: tuple[int, torch.Tensor] | None = None

    def _piece_at(self, index: int):
        epoch, offset = divmod(index, len(self.pieces))
        if self._order is None or self._order[0] != epoch:
            generator = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
            self._order = (epoch, torch.randperm(len(self.pieces), generator=generator))
        return self.pieces[int(self._order[1][offset])]

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        start = self.position + self.dp_rank * self.micro_batch
        batch = [self._piece_at(i) for i in range(start, start + self.micro_batch)]
        self.position += self.micro_batch * self.dp_size
        return collate(batch, self.seq_len, self.pad_id)

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.position = int(state_dict["position"])


# =============================================================================================
# Model, training stages, and greedy captions for the task metric
# =============================================================================================


def build_model(cfg: ModelConfig, processor: LlavaProcessor, seq_len: int) -> LlavaForConditionalGeneration:
    if cfg.pretrained_path:
        return LlavaForConditionalGeneration.from_pretrained(
            confined_path(cfg.pretrained_path), attn_implementation=cfg.attn_implementation, dtype=torch.float32
        )
    tokenizer = processor.tokenizer
    vision = SiglipVisionConfig(
        hidden_size=cfg.vision_hidden_size,
        intermediate_size=4 * cfg.vision_hidden_size,
        num_hidden_layers=cfg.vision_layers,
        num_attention_heads=max(1, cfg.vision_hidden_size // 32),
        image_size=processor.image_processor.size["height"],
        patch_size=cfg.patch_size,
        vision_use_head=False,  # LLaVA reads the patches' hidden states, never SigLIP's pooling head
    )
    language = load_language_model(cfg.language_model_path, len(tokenizer), seq_len) if cfg.language_model_path else None
    text = language.config if language is not None else LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=2 * seq_len,  # room for generated captions after a full prompt
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    config = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_id=processor.image_token_id,
        image_seq_length=image_tokens(processor),
        vision_feature_select_strategy="full",  # SigLIP has no class token: every patch is a token
        vision_feature_layer=-1,
        projector_hidden_act="gelu",
        tie_word_embeddings=False,
    )
    config._attn_implementation = cfg.attn_implementation
    model = LlavaForConditionalGeneration(config)
    if language is not None:  # its weights; the vision tower and projector are new
        model.model.language_model.load_state_dict(language.model.state_dict())
        model.lm_head.load_state_dict(language.lm_head.state_dict())
    return model


def load_language_model(path: str, vocab_size: int, seq_len: int) -> LlamaForCausalLM:
    """A Llama model exported by ``causal_lm`` or ``sft`` (the same byte ids), with a row added
    for ``<image>``."""
    language = AutoModelForCausalLM.from_pretrained(confined_path(path), dtype=torch.float32)
    if not isinstance(language, LlamaForCausalLM) or language.config.vocab_size != vocab_size - 1:
        raise ConfigError(f"model.language_model_path={path} is not a Llama model on the byte tokenizer "
                          f"({vocab_size - 1} tokens); give a causal_lm or sft export")
    if language.config.max_position_embeddings < seq_len:
        raise ConfigError(f"model.language_model_path={path} takes at most "
                          f"{language.config.max_position_embeddings} positions; lower data.seq_len")
    language.resize_token_embeddings(vocab_size)
    language.config.tie_word_embeddings = False
    return language


def trainable_parts(cfg: ModelConfig) -> tuple[str, ...]:
    """The modules the stage trains (transformers' names); the rest is frozen."""
    parts = ("model.multi_modal_projector",)
    if cfg.stage == "finetune":
        parts += ("model.language_model", "lm_head")
    if cfg.train_vision_tower:
        parts += ("model.vision_tower",)
    return parts


def freeze_for_stage(model: torch.nn.Module, cfg: ModelConfig) -> None:
    parts = trainable_parts(cfg)
    for name, param in model.named_parameters():
        param.requires_grad_(any(name == part or name.startswith(part + ".") for part in parts))


@torch.no_grad()
def greedy_captions(model, processor: LlavaProcessor, pixels: torch.Tensor, max_new_tokens: int,
                    prefix: str = "") -> list[str]:
    """The model's greedy caption of each image (one batch: every prompt has the same length)."""
    tokenizer = processor.tokenizer
    prompt = [processor.image_token_id] * image_tokens(processor) + text_tokens(tokenizer, prefix)
    input_ids = torch.tensor([prompt] * len(pixels))
    device = next(model.parameters()).device
    output = model.generate(
        input_ids=input_ids.to(device),
        attention_mask=torch.ones_like(input_ids).to(device),
        pixel_values=pixels.to(device),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return [tokenizer.decode(row[len(prompt):], skip_special_tokens=True).strip() for row in output.tolist()]


def caption_scores(captions: list[str], expected: list[str]) -> dict[str, float]:
    """``caption_accuracy``: the share of captions naming exactly the right shape, colour and
    position; and each attribute's accuracy alone."""
    hits = {name: 0 for name in ATTRIBUTES}
    whole = 0
    for said, truth in zip(captions, expected):
        got, want = attributes(said), attributes(truth)
        right = {name: got[name] == want[name] for name in ATTRIBUTES}
        whole += all(right.values())
        for name, ok in right.items():
            hits[name] += ok
    scores = {"caption_accuracy": whole / len(expected)}
    scores.update({f"{name}_accuracy": hits[name] / len(expected) for name in ATTRIBUTES})
    return scores


# =============================================================================================
# The recipe
# =============================================================================================


class VLM(Engine):
    """Image captioning with a LLaVA-style model; the loss covers the caption's tokens only."""

    config_class = VLMConfig

    @cached_property
    def processor(self) -> LlavaProcessor:
        return load_processor(self.config)

    def prepare_model(self) -> torch.nn.Module:
        model = build_model(self.config.model, self.processor, self.config.data.seq_len)
        freeze_for_stage(model, self.config.model)
        model = model.to(self.device)
        model = apply_fsdp(model, self.dist, self.config.parallel)
        return model

    def prepare_optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        optim = self.config.optim
        if optim.name == "adamw_8bit":  # 8-bit states: a quarter of AdamW's memory
            return adamw_8bit([p for p in model.parameters() if p.requires_grad], optim)
        return torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad],
            lr=optim.lr,
            betas=(optim.beta1, optim.beta2),
            eps=optim.eps,
            weight_decay=optim.weight_decay,
            fused=True,
        )

    @classmethod
    def summarize_data(cls, config: VLMConfig) -> DataSummary:
        cfg, listing = config.data, DataListing()
        store = example_store(cfg, load_processor(config), listing)
        tokenizer = f"from {config.model.pretrained_path}" if config.model.pretrained_path else "bytes + <image>"
        if store is None:  # the run reads and stores the images as its first phase
            files = sum(path.suffix == ".jsonl" for path in listing.files)
            return DataSummary.left_to_run(cfg.source, cfg.paths, files, sum(path.stat().st_size for path in listing.files),
                                           tokenizer=tokenizer, **listing.summary_fields())
        if not store.counts["train_documents"]:
            raise ConfigError(f"no training images: data.eval_fraction={cfg.eval_fraction} holds out all of them")
        return DataSummary(source=cfg.source, paths=cfg.paths[:20], tokenizer=tokenizer, **store.counts,
                           **listing.summary_fields())

    @cached_property
    def store(self) -> TokenStore:
        """The examples, mapped (built by the launch check, or now when it was not)."""
        return example_store(self.config.data, self.processor, self.data_listing)

    @cached_property
    def held_out(self) -> StoredExamples:
        return StoredExamples(self.store, "eval", self.processor)

    def stream(self, split: str, seed: int) -> BatchStream:
        cfg = self.config.data
        return BatchStream(
            StoredExamples(self.store, split, self.processor),
            cfg.seq_len,
            self.processor.tokenizer.pad_token_id,
            seed=seed,
            micro_batch=self.micro_batch_size,
            dp_rank=self.dist.dp_rank,
            dp_size=self.dist.dp_size,
        )

    def prepare_data(self) -> BatchStream:
        if not self.store.counts["train_documents"]:
            raise ConfigError(f"no training images: data.eval_fraction={self.config.data.eval_fraction} "
                              "holds out all of them")
        return self.stream("train", self.config.train.seed)

    def prepare_eval_data(self) -> list[dict[str, torch.Tensor]] | None:
        if not self.config.train.eval_every or not self.store.counts["eval_documents"]:
            return None
        stream = self.stream("eval", seed=0)
        return [next(stream) for _ in range(self.config.train.eval_batches)]

    def compute_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = self.model(
            input_ids=batch["input_ids"],
            pixel_values=batch["pixel_values"],
            position_ids=batch["position_ids"],
            use_cache=False,
        ).logits
        return F.cross_entropy(
            logits.flatten(0, 1).float(),
            batch["labels"].flatten(),
            ignore_index=IGNORE_INDEX,
            reduction="sum",
        )

    def flops_per_token(self) -> float:
        text = self.model.config.text_config
        return transformer_flops_per_token(
            non_embedding_params(self.model), text.num_hidden_layers, text.hidden_size, self.config.data.seq_len
        )

    def evaluate(self) -> float:
        """The eval loss; during training the caption accuracy is logged beside it (``evaluate``
        of ``engine.model_io`` asks ``task_metrics()`` for it itself)."""
        loss = super().evaluate()
        if "optimizer" in vars(self):
            was_training = self.model.training
            self.model.eval()
            self.logger.log({"step": self.state.step, **self.task_metrics()})
            self.model.train(was_training)
        return loss

    # Looking at the model: export, sample, evaluate ------------------------------------------

    def hf_model(self):
        return self.model

    def hf_processing(self):
        return self.processor

    def sample_inputs(self, index: int, prompt: str) -> tuple[dict[str, Any], dict[str, Any]]:
        """``sample``: prompt ``i`` is the beginning of a caption (``"a"``) of held-out image ``i``."""
        held_out = self.held_out
        if not len(held_out):
            raise ConfigError("no images are held out (data.eval_fraction=0): sample has no image to caption")
        name, text = held_out.about(index % len(held_out))
        tokens = [self.processor.image_token_id] * image_tokens(self.processor)
        tokens += text_tokens(self.processor.tokenizer, prompt)
        image = held_out.image(index % len(held_out))
        inputs = {"input_ids": torch.tensor([tokens]), "pixel_values": pixel_values(self.processor, [image])}
        shown = text if len(text) <= 1000 else text[:1000] + "…"  # 8 of them stay far below the result's 1 MB
        return inputs, {"input": f"held-out image {name}", "expected": shown}

    def task_metrics(self) -> dict[str, float]:
        """``caption_accuracy`` (and per attribute) of greedy captions of held-out images; on
        files, ``caption_accuracy`` is the share of captions exactly right."""
        shown = range(min(len(self.held_out), self.config.data.eval_prompts))
        if not shown:
            return {}
        was_training = self.model.training
        self.model.eval()
        pixels = pixel_values(self.processor, [self.held_out.image(i) for i in shown])
        room = self.config.data.seq_len - image_tokens(self.processor)  # as long as a trained caption
        said = greedy_captions(self.model, self.processor, pixels, room)
        self.model.train(was_training)
        expected = [self.held_out.about(i)[1] for i in shown]
        if self.config.data.source == "builtin":
            return caption_scores(said, expected)
        return {"caption_accuracy": sum(s == e.strip() for s, e in zip(said, expected)) / len(expected)}
