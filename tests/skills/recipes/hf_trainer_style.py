"""A class-based trainer around Hugging Face's LlamaForCausalLM, with FSDP2 on a (dp, tp) mesh.

Runs as one process (``python hf_trainer_style.py``) or under
``torchrun --nproc-per-node N hf_trainer_style.py --tp T``. The data are synthetic documents of
varied length (counting sequences of tokens), right-padded into batches.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader
from transformers import LlamaConfig, LlamaForCausalLM

PAD_ID = 0


@dataclass
class TrainConfig:
    vocab_size: int = 64
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    seq_len: int = 64
    batch_size: int = 8
    steps: int = 8
    lr: float = 1e-2
    tp: int = 1
    seed: int = 0


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_documents(count: int, vocab_size: int, seq_len: int, seed: int) -> list[list[int]]:
    """Counting sequences (step 1 or 2, mod the vocabulary) of 8 to seq_len tokens: learnable in a
    few steps."""
    generator = torch.Generator().manual_seed(seed)
    documents = []
    for _ in range(count):
        length = int(torch.randint(8, seq_len + 1, (1,), generator=generator))
        start = int(torch.randint(1, vocab_size, (1,), generator=generator))
        stride = 1 + int(torch.randint(0, 2, (1,), generator=generator))
        documents.append([1 + (start + i * stride) % (vocab_size - 1) for i in range(length)])
    return documents


def collate(documents: list[list[int]], seq_len: int, pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad to seq_len; the model shifts the labels itself, padding is ignored (-100)."""
    input_ids = torch.full((len(documents), seq_len), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(documents), seq_len), dtype=torch.long)
    for row, document in enumerate(documents):
        tokens = torch.tensor(document[:seq_len], dtype=torch.long)
        input_ids[row, : len(tokens)] = tokens
        attention_mask[row, : len(tokens)] = 1
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


class Trainer:
    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        if not dist.is_initialized():
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(free_port()))
            os.environ.setdefault("RANK", "0")
            os.environ.setdefault("WORLD_SIZE", "1")
            dist.init_process_group("gloo")
        world_size = dist.get_world_size()
        self.mesh = init_device_mesh("cpu", (world_size // cfg.tp, cfg.tp), mesh_dim_names=("dp", "tp"))
        self.is_main = dist.get_rank() == 0

        torch.manual_seed(cfg.seed)
        config = LlamaConfig(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_hidden_layers=cfg.num_layers,
            num_attention_heads=cfg.num_heads,
            num_key_value_heads=cfg.num_kv_heads,
            max_position_embeddings=cfg.seq_len,
            attn_implementation="sdpa",
        )
        self.model = LlamaForCausalLM(config)
        # FSDP2: shard each decoder layer, then the rest.
        for layer in self.model.model.layers:
            fully_shard(layer, mesh=self.mesh["dp"])
        fully_shard(self.model, mesh=self.mesh["dp"])
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, weight_decay=0.0)

        documents = make_documents(256, cfg.vocab_size, cfg.seq_len, cfg.seed)
        self.loader = DataLoader(
            documents,
            batch_size=cfg.batch_size,
            shuffle=True,
            collate_fn=partial(collate, seq_len=cfg.seq_len, pad_id=PAD_ID),
            generator=torch.Generator().manual_seed(cfg.seed),
        )

    def train_step(self, batch: dict[str, torch.Tensor]) -> float:
        outputs = self.model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            labels=batch["labels"],
            use_cache=False,
        )
        loss = outputs.loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        return loss.item()

    def train(self) -> None:
        step = 0
        while step < self.cfg.steps:
            for batch in self.loader:
                loss = self.train_step(batch)
                step += 1
                if self.is_main:
                    print(f"step {step} loss {loss:.6f}", flush=True)
                if step == self.cfg.steps:
                    break


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=TrainConfig.steps)
    parser.add_argument("--tp", type=int, default=TrainConfig.tp)
    parser.add_argument("--seed", type=int, default=TrainConfig.seed)
    args = parser.parse_args()
    trainer = Trainer(TrainConfig(steps=args.steps, tp=args.tp, seed=args.seed))
    trainer.train()
    dist.barrier()  # every rank is done before any closes its gloo connections
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
