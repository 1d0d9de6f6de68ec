"""An MNIST-style ConvNet classifier, trained with a plain loop on random images (2 steps)."""

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
steps = 2


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.fc1 = nn.Linear(16 * 7 * 7, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(x.flatten(1)))
        return self.fc2(x)


model = ConvNet()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

for step in range(steps):
    images = torch.randn(8, 1, 28, 28)
    labels = torch.randint(0, 10, (8,))
    logits = model(images)
    loss = F.cross_entropy(logits, labels)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    print(f"step {step} loss {loss.item():.6f}")
