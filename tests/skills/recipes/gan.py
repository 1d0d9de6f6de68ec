"""A small GAN on random 2-D data: a generator of repeated blocks and an MLP discriminator, each
with its own optimizer (2 steps)."""

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
steps = 2
noise_dim = 8


class GenBlock(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, x):
        return x + F.relu(self.linear(self.norm(x)))


class Generator(nn.Module):
    def __init__(self, width=32):
        super().__init__()
        self.inp = nn.Linear(noise_dim, width)
        self.blocks = nn.Sequential(GenBlock(width), GenBlock(width), GenBlock(width))
        self.out = nn.Linear(width, 2)

    def forward(self, z):
        return self.out(self.blocks(self.inp(z)))


class Discriminator(nn.Module):
    def __init__(self, width=32):
        super().__init__()
        self.main = nn.Sequential(nn.Linear(2, width), nn.LeakyReLU(0.2), nn.Linear(width, 1))

    def forward(self, x):
        return self.main(x)


netG = Generator()
netD = Discriminator()
optD = torch.optim.Adam(netD.parameters(), lr=2e-4)
optG = torch.optim.Adam(netG.parameters(), lr=2e-4)

for step in range(steps):
    real = torch.randn(16, 2) * 0.5 + 1.0
    fake = netG(torch.randn(16, noise_dim))
    d_real = netD(real)
    d_fake = netD(fake.detach())
    loss_d = F.binary_cross_entropy_with_logits(d_real, torch.ones_like(d_real)) + F.binary_cross_entropy_with_logits(
        d_fake, torch.zeros_like(d_fake)
    )
    optD.zero_grad()
    loss_d.backward()
    optD.step()
    d_out = netD(fake)
    loss_g = F.binary_cross_entropy_with_logits(d_out, torch.ones_like(d_out))
    optG.zero_grad()
    loss_g.backward()
    optG.step()
    print(f"step {step} loss {loss_g.item():.6f} d_loss {loss_d.item():.6f}")
