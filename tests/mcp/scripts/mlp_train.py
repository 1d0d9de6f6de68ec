"""A plain PyTorch training script of the kind people write: its own model, data, optimizer and
loop, printing one JSON line per step. Under torchrun (WORLD_SIZE > 1) it averages gradients
over the processes itself; rank 0 prints and saves. ``--resume PATH`` continues a checkpoint it
saved (``checkpoints/ckpt_<step>.pt`` in its working directory)."""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--save-every", type=int, default=0)
parser.add_argument("--sleep", type=float, default=0.0)
parser.add_argument("--resume", default=None)
options = parser.parse_args()

torch.manual_seed(0)
world = int(os.environ.get("WORLD_SIZE", "1"))
rank = int(os.environ.get("RANK", "0"))
if world > 1:
    dist.init_process_group("gloo")


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


model = MLP()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
start = 0
if options.resume:
    state = torch.load(options.resume)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    start = state["step"]
    print(f"resumed from {options.resume} at step {start}", flush=True)

generator = torch.Generator().manual_seed(rank)
inputs = torch.randn(64, 16, generator=generator)
targets = torch.randint(0, 4, (64,), generator=generator)
for step in range(start + 1, options.steps + 1):
    logits = model(inputs)
    loss = F.cross_entropy(logits, targets)
    optimizer.zero_grad()
    loss.backward()
    if world > 1:
        for parameter in model.parameters():
            dist.all_reduce(parameter.grad)
            parameter.grad /= world
    optimizer.step()
    if rank == 0:
        print(json.dumps({"step": step, "loss": loss.item(), "world_size": world}))
        if options.save_every and step % options.save_every == 0:
            os.makedirs("checkpoints", exist_ok=True)
            partial = f"checkpoints/.ckpt_{step}.pt.tmp"  # hidden until complete: never listed half-written
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, partial)
            os.replace(partial, f"checkpoints/ckpt_{step}.pt")
    time.sleep(options.sleep)
print(f"rank {rank} done", flush=True)
