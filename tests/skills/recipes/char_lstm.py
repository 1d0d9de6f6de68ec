"""A character-level LSTM language model, trained with a plain loop on random text (2 steps)."""

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
steps = 2
vocab_size = 64


class CharLSTM(nn.Module):
    def __init__(self, vocab_size, hidden=32):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, hidden)
        self.lstm = nn.LSTM(hidden, hidden, num_layers=2, batch_first=True)
        self.head = nn.Linear(hidden, vocab_size)

    def forward(self, tokens):
        out, _ = self.lstm(self.embed(tokens))
        return self.head(out)


model = CharLSTM(vocab_size)
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)

for step in range(steps):
    text = torch.randint(0, vocab_size, (4, 17))
    logits = model(text[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, vocab_size), text[:, 1:].reshape(-1))
    optimizer.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    print(f"step {step} loss {loss.item():.6f}")
