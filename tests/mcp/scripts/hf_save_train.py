"""A training script as TRL or the Hugging Face Trainer would leave its checkpoints: it loads a
causal LM from a folder, trains it a few steps on a short text (with a peft LoRA adapter under
--lora), prints one JSON line per step and saves checkpoints/checkpoint-N/ with save_pretrained
(the model, or the adapter, and the tokenizer)."""

import argparse
import json

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

parser = argparse.ArgumentParser()
parser.add_argument("--base", required=True)
parser.add_argument("--steps", type=int, default=2)
parser.add_argument("--lora", action="store_true")
args = parser.parse_args()

torch.manual_seed(0)
tokenizer = AutoTokenizer.from_pretrained(args.base)
model = AutoModelForCausalLM.from_pretrained(args.base, torch_dtype=torch.float32)
if args.lora:
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                             init_lora_weights=False))
optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
ids = tokenizer("def add(a, b):\n    return a + b\n" * 4, return_tensors="pt")["input_ids"]
for step in range(1, args.steps + 1):
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    print(json.dumps({"step": step, "loss": loss.item()}), flush=True)
folder = f"checkpoints/checkpoint-{args.steps}"
model.save_pretrained(folder)
tokenizer.save_pretrained(folder)
