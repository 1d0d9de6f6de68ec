"""A re-creation of accelerate's ``examples/nlp_example.py`` (the examples are not in the PyPI
archives): ``training_function(config, args)``, a sequence classifier from ``from_pretrained``,
``accelerator.prepare``, ``accelerator.backward``.

Data: random token ids and labels instead of GLUE/MRPC, and no warm-up (the changes of substance).
    python accelerate_loop.py --model_name_or_path DIR --max_steps 2
"""

import argparse

import torch
from accelerate import Accelerator
from torch.optim import AdamW
from torch.utils.data import DataLoader
from transformers import AutoModelForSequenceClassification, get_linear_schedule_with_warmup, set_seed


def get_dataloaders(accelerator: Accelerator, batch_size: int, vocab_size: int, seq_len: int = 16):
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab_size, (32, seq_len), generator=generator)
    labels = torch.randint(0, 2, (32,), generator=generator)
    rows = [{"input_ids": i, "attention_mask": torch.ones_like(i), "labels": y} for i, y in zip(ids, labels)]
    train_dataloader = DataLoader(rows, shuffle=True, batch_size=batch_size)
    eval_dataloader = DataLoader(rows[:8], shuffle=False, batch_size=batch_size)
    return train_dataloader, eval_dataloader


def training_function(config, args):
    accelerator = Accelerator(cpu=args.cpu, mixed_precision=args.mixed_precision)
    lr = config["lr"]
    num_epochs = int(config["num_epochs"])
    seed = int(config["seed"])
    batch_size = int(config["batch_size"])

    set_seed(seed)
    model = AutoModelForSequenceClassification.from_pretrained(args.model_name_or_path, num_labels=2)
    train_dataloader, eval_dataloader = get_dataloaders(accelerator, batch_size, model.config.vocab_size)
    model = model.to(accelerator.device)
    optimizer = AdamW(params=model.parameters(), lr=lr)
    lr_scheduler = get_linear_schedule_with_warmup(
        optimizer=optimizer,
        num_warmup_steps=0,  # 100 in the example: its first 2 steps would not move the weights
        num_training_steps=(len(train_dataloader) * num_epochs),
    )
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
    )

    steps = 0
    for epoch in range(num_epochs):
        model.train()
        for step, batch in enumerate(train_dataloader):
            batch.to(accelerator.device) if hasattr(batch, "to") else None
            outputs = model(**batch)
            loss = outputs.loss
            accelerator.backward(loss)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
            steps += 1
            accelerator.print(f"step {steps} loss {loss.item():.4f}")
            if steps >= args.max_steps:
                return


def main():
    parser = argparse.ArgumentParser(description="Simple example of training script.")
    parser.add_argument("--model_name_or_path", type=str, required=True)
    parser.add_argument("--mixed_precision", type=str, default=None, choices=["no", "fp16", "bf16", "fp8"])
    parser.add_argument("--cpu", action="store_true", help="If passed, will train on the CPU.")
    parser.add_argument("--max_steps", type=int, default=2)
    args = parser.parse_args()
    config = {"lr": 2e-5, "num_epochs": 1, "seed": 42, "batch_size": 4}
    training_function(config, args)


if __name__ == "__main__":
    main()
