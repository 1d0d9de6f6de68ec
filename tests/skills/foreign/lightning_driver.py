"""Data and Trainer shim for Lightning's own ``lightning/pytorch/demos/transformer.py`` (fetched
from the ``lightning`` wheel by the corpus): that file defines ``LightningTransformer`` but
downloads WikiText-2 and has no entry point. This runs it for ``max_steps`` on random tokens with
a small vocabulary, on CPU, without logger or checkpoints; the module under test is unchanged.

    python lightning_driver.py PATH/TO/transformer.py [max_steps]
"""

import runpy
import sys

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

demo = runpy.run_path(sys.argv[1], run_name="lightning_demo_transformer")
max_steps = int(sys.argv[2]) if len(sys.argv) > 2 else 2
vocab_size = 64

torch.manual_seed(0)
model = demo["LightningTransformer"](vocab_size=vocab_size)
tokens = torch.randint(0, vocab_size, (16, 9))
data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=4)
model.prepare_data = lambda: None  # no download
model.train_dataloader = lambda: data

losses = []


class PrintLoss(L.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        loss = float(outputs["loss"])
        losses.append(loss)
        print(f"step {trainer.global_step} loss {loss:.4f}")


trainer = L.Trainer(
    max_steps=max_steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
    enable_progress_bar=False, enable_model_summary=False, callbacks=[PrintLoss()],
)
trainer.fit(model)
