"""What a token store would save the ``vlm_chat`` template: where encoding an example's time goes,
and what a piece holds in memory.

``vlm_chat`` encodes every example before its first step (``encode``: the chat template rendered
turn by turn to find the assistant's spans, then the processor, which tokenizes the text and
decodes, resizes and normalises the images) and keeps each piece's image tensors in memory. A
token store (``engine/token_store.py``) keeps token rows and loss masks: on a second launch it
saves the rendering and the tokenizing, not the images' processing, which is needed for every
batch either way. This prints, per example of the template's built-in questions with images of
``--width`` × ``--height`` pixels, under LLaVA-1.5's image processing (shortest edge 336, centre
crop 336, 14-pixel patches: 576 image tokens; a tiny random LLaVA otherwise, built offline):

- the time of ``encode`` per example, of its template rendering, of tokenizing the rendered text,
  and the rest (the images' processing, offsets and masks), each round printed;
- the bytes of image tensors a piece holds, against its token row and targets as int32.

    python bench/vlm_data_cost.py [--examples 40] [--rounds 3]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--width", type=int, default=640)
    parser.add_argument("--height", type=int, default=480)
    args = parser.parse_args()

    from PIL import Image
    from transformers import CLIPImageProcessorPil

    from engine.chat import assistant_spans
    from recipes_template.vlm_chat import recipe as vlm
    from tests.vlm_families import tiny_vlm_folder

    with tempfile.TemporaryDirectory() as scratch:
        processor = vlm.load_processor(str(tiny_vlm_folder(Path(scratch) / "llava", "llava")))
    processor.image_processor = CLIPImageProcessorPil(size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336})
    processor.patch_size = 14
    rng = np.random.default_rng(0)
    examples = [(where, messages, [Image.fromarray(rng.integers(0, 255, (args.height, args.width, 3), dtype=np.uint8))
                                   for _ in images])
                for where, messages, images in vlm.builtin_examples(args.examples, 56)]
    shares = []
    for round_ in range(1, args.rounds + 1):
        rendering = tokenizing = encoding = 0.0
        held = tokens = 0
        for where, messages, images in examples:
            start = time.perf_counter()
            text, _ = assistant_spans(processor, messages, where)
            rendered = time.perf_counter()
            processor.tokenizer(text)
            tokenized = time.perf_counter()
            piece = vlm.encode(processor, messages, images, 4096, where)
            encoding += time.perf_counter() - tokenized
            rendering += rendered - start
            tokenizing += tokenized - rendered
            held += sum(v.numel() * v.element_size() for v in piece["images"].values() if hasattr(v, "numel"))
            tokens += len(piece["ids"])
        n = len(examples)
        shares.append((rendering + tokenizing) / encoding)
        print(f"round {round_}: encode {1000 * encoding / n:.1f} ms/example: template rendering "
              f"{1000 * rendering / n:.1f} ms, tokenizing {1000 * tokenizing / n:.2f} ms, the rest (images, offsets, "
              f"masks) {1000 * (encoding - rendering - tokenizing) / n:.1f} ms; per piece {held / n / 1e6:.2f} MB of "
              f"image tensors, {8 * tokens / n / 1e3:.1f} KB of token row and targets (int32)", flush=True)
    print(f"what a store saves of encoding (rendering + tokenizing / encode), median of {len(shares)} rounds: "
          f"{sorted(shares)[len(shares) // 2]:.1%}")


if __name__ == "__main__":
    main()
