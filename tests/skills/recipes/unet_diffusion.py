"""A U-Net-style denoiser trained with the DDPM noise-prediction loss on random images (2 steps)."""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
steps = 2
timesteps = 100
betas = torch.linspace(1e-4, 0.02, timesteps)
alphas_bar = torch.cumprod(1 - betas, dim=0)


def time_embedding(t, dim):
    half = dim // 2
    freqs = torch.exp(-math.log(10000) * torch.arange(half) / half)
    angles = t[:, None].float() * freqs[None]
    return torch.cat([angles.sin(), angles.cos()], dim=1)


class ResBlock(nn.Module):
    def __init__(self, c_in, c_out, t_dim):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, padding=1)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1)
        self.time = nn.Linear(t_dim, c_out)
        self.skip = nn.Conv2d(c_in, c_out, 1)

    def forward(self, x, t):
        h = F.silu(self.conv1(x)) + self.time(t)[:, :, None, None]
        return self.skip(x) + F.silu(self.conv2(h))


class UNet(nn.Module):
    def __init__(self, channels=(8, 16), t_dim=16):
        super().__init__()
        self.t_dim = t_dim
        self.inp = nn.Conv2d(1, channels[0], 3, padding=1)
        self.down = nn.ModuleList([ResBlock(channels[0], channels[1], t_dim), ResBlock(channels[1], channels[1], t_dim)])
        self.up = nn.ModuleList([ResBlock(2 * channels[1], channels[1], t_dim), ResBlock(channels[1] + channels[0], channels[0], t_dim)])
        self.out = nn.Conv2d(channels[0], 1, 1)

    def forward(self, x, t):
        t = time_embedding(t, self.t_dim)
        h = self.inp(x)
        skips = []
        for block in self.down:
            skips.append(h)
            h = block(F.avg_pool2d(h, 2), t)
        for block in self.up:
            skip = skips.pop()
            h = F.interpolate(h, size=skip.shape[-2:])
            h = block(torch.cat([h, skip], dim=1), t)
        return self.out(h)


model = UNet()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

for step in range(steps):
    images = torch.randn(4, 1, 16, 16)
    t = torch.randint(0, timesteps, (4,))
    noise = torch.randn_like(images)
    a = alphas_bar[t].sqrt()[:, None, None, None]
    noisy = a * images + (1 - alphas_bar[t]).sqrt()[:, None, None, None] * noise
    loss = F.mse_loss(model(noisy, t), noise)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    print(f"step {step} loss {loss.item():.6f}")
