"""A script run's checkpoint that is a Hugging Face model folder, as ``engine.model_io`` loads it.

TRL and the Hugging Face Trainer save ``checkpoint-N/`` as a model folder: ``config.json`` and
the weights (``save_pretrained``), or a peft adapter (``adapter_config.json`` and its weights,
over the base model its config names), usually with the tokenizer beside them. Such a folder is
loaded with transformers (and peft) alone — no code of the script runs, and no remote code —
into a :class:`CheckpointModel`, which has the hooks of a recipe's ``Engine`` that export and
sample use. Evaluation reads the files given (a script has no held-out split that trainwright
knows) and reports the loss over their tokens, each document cut to the model's context.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.errors import BadInput
from engine.run_checkpoints import HF_ADAPTER_CONFIG as ADAPTER_CONFIG
from engine.run_checkpoints import HF_MODEL_CONFIG as CONFIG
from engine.run_checkpoints import is_model_folder
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
MAX_EVAL_TOKENS = 1024  # a document is cut to this (or the model's context, if shorter)
MAX_EVAL_DOCUMENTS = 10_000
TEXT_SUFFIXES = (".txt", ".md", ".py", ".rst", ".json", ".jsonl", ".csv")


@dataclass
class CheckpointModel:
    """A model loaded from a folder, with the ``Engine`` hooks export and sample call."""

    model: Any
    tokenizer: Any
    device: Any

    def hf_model(self) -> Any:
        return self.model

    def hf_processing(self) -> Any:
        return self.tokenizer

    def sample_inputs(self, index: int, prompt: str) -> None:
        return None  # text only


def load_checkpoint_model(folder: Path, run_id: str) -> CheckpointModel:
    """The model (float32, eval mode, on CUDA where there is one) and tokenizer of ``folder``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.distributed import pick_device

    folder = Path(folder)
    if not is_model_folder(folder):
        raise BadInput(f"checkpoint {folder.name} of script run {run_id} is not a Hugging Face model folder "
                       f"(no {CONFIG} or {ADAPTER_CONFIG}); save it with save_pretrained, as TRL and the "
                       "Hugging Face Trainer do")
    try:
        if (folder / ADAPTER_CONFIG).is_file():
            from peft import AutoPeftModelForCausalLM

            # The transformers model with the adapter's layers in it, as the lora skill's runs
            # hold theirs (peft_config on it): hf_export merges or saves it as it does theirs.
            model = AutoPeftModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).base_model.model
        else:
            model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32)
        tokenizer = (AutoTokenizer.from_pretrained(folder) if any((folder / n).is_file() for n in TOKENIZER_FILES)
                     else None)
    except (OSError, ValueError, KeyError) as e:  # a base model that is not there, a config transformers refuses
        raise BadInput(f"checkpoint {folder.name} of script run {run_id} cannot be loaded with transformers "
                       f"({type(e).__name__}: {str(e).splitlines()[0][:400]})") from None
    device = pick_device(0)
    model.to(device).eval()
    return CheckpointModel(model, tokenizer, device)


def documents(paths: list[str]) -> list[str]:
    """The text of each file given, a folder's files (sorted, of :data:`TEXT_SUFFIXES`) each."""
    files: list[Path] = []
    for given in paths:
        path = Path(given)
        if path.is_dir():
            files += sorted(p for p in path.rglob("*") if p.is_file() and not p.is_symlink()
                            and p.suffix in TEXT_SUFFIXES)
        elif path.is_file():
            files.append(path)
    texts = [p.read_text(errors="replace") for p in files[:MAX_EVAL_DOCUMENTS]]
    return [t for t in texts if t.strip()]


def evaluate_model(loaded: CheckpointModel, paths: list[str]) -> dict[str, Any]:
    """Eval loss and next-token accuracy over the documents of ``paths``: every token after a
    document's first is scored, each document cut to the model's context."""
    import torch

    if loaded.tokenizer is None:
        raise BadInput("the checkpoint has no tokenizer, so its model cannot read the files given; save the "
                       "tokenizer in the checkpoint (tokenizer.save_pretrained)")
    texts = documents(paths)
    if not texts:
        raise BadInput(f"the data given holds no text files ({', '.join(TEXT_SUFFIXES)}) to evaluate on")
    context = getattr(loaded.model.config, "max_position_embeddings", None) or MAX_EVAL_TOKENS
    limit = min(MAX_EVAL_TOKENS, int(context))
    total_loss, scored, correct, tokens = 0.0, 0, 0, 0
    with torch.no_grad():
        for text in texts:
            ids = loaded.tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"][:, :limit]
            tokens += ids.shape[1]
            if ids.shape[1] < 2:
                continue
            ids = ids.to(loaded.device)
            logits = loaded.model(input_ids=ids).logits[0, :-1].float()
            targets = ids[0, 1:]
            total_loss += float(torch.nn.functional.cross_entropy(logits, targets, reduction="sum"))
            correct += int((logits.argmax(-1) == targets).sum())
            scored += targets.numel()
    if scored == 0:
        raise BadInput("the documents given are each shorter than two tokens: nothing to score")
    loss = total_loss / scored
    return {"eval_loss": loss if math.isfinite(loss) else None, "examples": len(texts), "tokens": tokens,
            "loss_tokens": scored, "scored_tokens": scored, "metrics": {"next_token_accuracy": correct / scored}}
