"""A hand-written LLaVA-style training script: a tiny SigLIP vision tower, a projector and a
Llama language model (transformers' LlavaForConditionalGeneration) learn to caption generated
pictures of coloured squares, with a plain loop (2 steps). It has no notion of training stages:
everything trains.

A piece is ``(tokens_and_targets, pixel_values)``: a 2 × n tensor (the image placeholder
expanded to the model's image-token count, then the caption; targets are the caption's tokens,
-100 elsewhere) and a 3 × H × W picture.
"""

from functools import partial

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader
from transformers import LlamaConfig, LlavaConfig, LlavaForConditionalGeneration, SiglipVisionConfig

torch.manual_seed(0)
steps = 2
IGNORE_INDEX = -100
EOS_ID, PAD_ID, IMAGE_ID = 256, 257, 258
IMAGE_SIZE, PATCH = 32, 8
IMAGE_TOKENS = (IMAGE_SIZE // PATCH) ** 2
COLOURS = {"red": (1.0, 0.0, 0.0), "green": (0.0, 1.0, 0.0), "blue": (0.0, 0.0, 1.0), "white": (1.0, 1.0, 1.0)}


def build_model() -> LlavaForConditionalGeneration:
    vision = SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        image_size=IMAGE_SIZE, patch_size=PATCH, vision_use_head=False,
    )
    text = LlamaConfig(
        vocab_size=IMAGE_ID + 1, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    )
    config = LlavaConfig(
        vision_config=vision, text_config=text, image_token_index=IMAGE_ID,
        vision_feature_layer=-1, vision_feature_select_strategy="full", projector_hidden_act="gelu",
    )
    return LlavaForConditionalGeneration(config)


def make_pieces(count: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Pictures of a coloured square in one corner, and captions of varied length."""
    generator = torch.Generator().manual_seed(seed)
    pieces = []
    for _ in range(count):
        colour = list(COLOURS)[int(torch.randint(len(COLOURS), (1,), generator=generator))]
        corner = int(torch.randint(4, (1,), generator=generator))
        image = torch.zeros(3, IMAGE_SIZE, IMAGE_SIZE)
        top, left = (corner // 2) * 16, (corner % 2) * 16
        image[:, top : top + 16, left : left + 16] = torch.tensor(COLOURS[colour])[:, None, None]
        words = ["a", colour, "square", "at", ("top" if corner < 2 else "bottom"), ("left" if corner % 2 == 0 else "right")]
        caption = " ".join(words + ["please"] * int(torch.randint(0, 6, (1,), generator=generator)))
        text = list(caption.encode()) + [EOS_ID]
        tokens = torch.tensor([IMAGE_ID] * IMAGE_TOKENS + text)
        targets = torch.tensor([IGNORE_INDEX] * IMAGE_TOKENS + text)
        pieces.append((torch.stack([tokens, targets]), image))
    return pieces


def collate(pieces, seq_len, pad_id):
    """Right-pad the pieces; labels are the next token's targets; pictures in row order."""
    width = min(seq_len, max(p[0].shape[-1] - 1 for p in pieces))
    input_ids = torch.full((len(pieces), width), pad_id, dtype=torch.int64)
    labels = torch.full((len(pieces), width), IGNORE_INDEX, dtype=torch.int64)
    attention_mask = torch.zeros((len(pieces), width), dtype=torch.int64)
    for row, (piece, _) in enumerate(pieces):
        n = piece.shape[-1] - 1
        input_ids[row, :n] = piece[0, :-1]
        labels[row, :n] = piece[1, 1:]
        attention_mask[row, :n] = 1
    pixel_values = torch.stack([image for _, image in pieces])
    return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask, "pixel_values": pixel_values}


model = build_model()
loader = DataLoader(make_pieces(64), batch_size=4, shuffle=False, collate_fn=partial(collate, seq_len=128, pad_id=PAD_ID))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

for step, batch in zip(range(steps), loader):
    logits = model(
        input_ids=batch["input_ids"],
        pixel_values=batch["pixel_values"],
        attention_mask=batch["attention_mask"],
    ).logits
    loss = F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten(), ignore_index=IGNORE_INDEX)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    print(f"step {step} loss {loss.item():.6f}")
