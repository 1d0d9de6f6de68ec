"""Run under torchrun (2 processes): sequence-parallel attention against the same model on the
whole sequence, computed on each rank. Prints one JSON line per case on rank 0."""

from __future__ import annotations

import copy
import json

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from transformers import LlamaConfig, LlamaForCausalLM

from engine.sequence_parallel import apply_sequence_parallel, shard_sequences


def loss_sum(model, batch, positions=True):
    extra = {"position_ids": batch["position_ids"]} if positions else {}
    logits = model(input_ids=batch["input_ids"], use_cache=False, **extra).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten(),
                                             ignore_index=-100, reduction="sum")


def batch_of(lengths_per_row, seq_len, vocab, generator):
    """Rows of documents of the given lengths; position ids restart per document (packing)."""
    rows = len(lengths_per_row)
    input_ids = torch.randint(0, vocab, (rows, seq_len), generator=generator)
    labels = torch.randint(0, vocab, (rows, seq_len), generator=generator)
    positions = torch.zeros(rows, seq_len, dtype=torch.int64)
    for row, lengths in enumerate(lengths_per_row):
        start = 0
        for n in lengths:
            positions[row, start:start + n] = torch.arange(n)
            start += n
        positions[row, start:] = torch.arange(seq_len - start)
        labels[row, start:] = -100
    return {"input_ids": input_ids, "labels": labels, "position_ids": positions}


def case(name, sp_mesh, kv_heads, lengths_per_row, seq_len=64, document_mask=True, positions=True):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=seq_len,
                         attn_implementation="sdpa")
    reference = LlamaForCausalLM(config)
    parallel = copy.deepcopy(reference)
    apply_sequence_parallel(parallel, sp_mesh)
    if not document_mask:  # a control: packed rows attended as one sequence must not match
        for module in parallel.modules():
            if hasattr(module, "_sequence_parallel"):
                module._sequence_parallel.document_mask = lambda positions: None
    batch = batch_of(lengths_per_row, seq_len, 97, torch.Generator().manual_seed(1))

    expected = loss_sum(reference, batch, positions)
    expected.backward()
    expected = expected.detach()
    got = loss_sum(parallel, shard_sequences(batch, sp_mesh), positions)
    got.backward()
    total = got.detach().clone()
    dist.all_reduce(total, group=sp_mesh.get_group())
    grad_diff = 0.0
    for (_, p), (_, q) in zip(reference.named_parameters(), parallel.named_parameters()):
        grad = q.grad.clone()
        dist.all_reduce(grad, group=sp_mesh.get_group())
        grad_diff = max(grad_diff, float((grad - p.grad).abs().max()))
    if dist.get_rank() == 0:
        print(json.dumps({"case": name, "loss": float(expected), "loss_diff": abs(float(total - expected)) / float(expected),
                          "grad_diff": grad_diff}), flush=True)


def refused_mask(sp_mesh):
    """A padding mask cannot be split with the sequence: the forward refuses it."""
    config = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    model = LlamaForCausalLM(config)
    apply_sequence_parallel(model, sp_mesh)
    ids = torch.zeros(1, 8, dtype=torch.int64)
    try:
        model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
        message = None
    except ValueError as error:
        message = str(error)
    if dist.get_rank() == 0:
        print(json.dumps({"case": "attention_mask", "refusal": message}), flush=True)


def main():
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("sp",))
    case("causal", mesh["sp"], 2, [[64], [40]])
    case("packed", mesh["sp"], 2, [[10, 30, 20], [33, 31]])
    case("kv_heads_below_sp", mesh["sp"], 1, [[17, 40], [64]])
    case("packed_without_document_mask", mesh["sp"], 2, [[10, 30, 20], [33, 31]], document_mask=False)
    case("without_position_ids", mesh["sp"], 2, [[64], [64]], positions=False)
    refused_mask(mesh["sp"])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
