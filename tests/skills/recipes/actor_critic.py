"""An actor-critic MLP (policy and value heads) for a small control task, trained with a plain
advantage actor-critic loss on random transitions (2 steps)."""

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
steps = 2
obs_dim, n_actions = 8, 4


class ActorCritic(nn.Module):
    def __init__(self, obs_dim, n_actions, hidden=32):
        super().__init__()
        self.actor = nn.Sequential(nn.Linear(obs_dim, hidden), nn.Tanh(), nn.Linear(hidden, n_actions))
        self.critic = nn.Sequential(nn.Linear(obs_dim, hidden), nn.Tanh(), nn.Linear(hidden, 1))

    def forward(self, obs):
        return self.actor(obs), self.critic(obs).squeeze(-1)


model = ActorCritic(obs_dim, n_actions)
optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)

for step in range(steps):
    obs = torch.randn(16, obs_dim)
    returns = torch.randn(16)
    logits, values = model(obs)
    dist = torch.distributions.Categorical(logits=logits)
    actions = dist.sample()
    advantage = (returns - values).detach()
    loss = -(dist.log_prob(actions) * advantage).mean() + F.mse_loss(values, returns)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    print(f"step {step} loss {loss.item():.6f}")
