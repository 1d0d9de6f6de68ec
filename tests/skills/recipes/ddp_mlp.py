"""A residual MLP regressor wrapped in DistributedDataParallel before its optimizer is built;
runs as one gloo process without torchrun (2 steps)."""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
dist.init_process_group("gloo", rank=int(os.environ.get("RANK", 0)), world_size=int(os.environ.get("WORLD_SIZE", 1)))
torch.manual_seed(0)
steps = 2


class ResidualBlock(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, x):
        return x + F.gelu(self.fc(self.norm(x)))


class ResidualMLP(nn.Module):
    def __init__(self, dim_in=8, width=32, depth=3):
        super().__init__()
        self.inp = nn.Linear(dim_in, width)
        self.layers = nn.ModuleList([ResidualBlock(width) for _ in range(depth)])
        self.out = nn.Linear(width, 1)

    def forward(self, x):
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return self.out(h).squeeze(-1)


model = ResidualMLP()
model = DDP(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

for step in range(steps):
    x = torch.randn(16, 8)
    y = x.sum(dim=1)
    loss = F.mse_loss(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    print(f"step {step} loss {loss.item():.6f}")
dist.destroy_process_group()
