"""Peak activation memory per rank with sequence parallelism: sp=1 against sp=2 (and more).

Each degree runs in its own processes (``torchrun --nproc-per-node SP``, gloo on CPU): the
template's default model (Llama-style, hidden 256, 4 layers, 4 heads, 2 key/value heads,
byte vocabulary) takes one forward and backward of one row of ``--seq-len`` tokens, split
over the sp ranks with ``engine.sequence_parallel`` exactly as a run does (no FSDP2: the
weights are the same on every rank and are not what is measured). Two measures per rank:

- saved: the bytes autograd keeps from forward to backward (unique storages of the tensors
  saved for backward, parameters excluded), counted with ``torch.autograd.graph.
  saved_tensors_hooks``. This is the activation memory proper, exact and deterministic.
- peak RSS: the process's resident memory high-water mark during forward + backward (Linux
  ``VmHWM``, reset through ``/proc/self/clear_refs`` just before the step) minus its resident
  memory just before: everything the step allocated at its peak — activations, attention's
  working memory, the all-to-all buffers, gradients. glibc is told to return large blocks at
  once (``MALLOC_MMAP_THRESHOLD_``), so freed memory does not hide in its caches.

    python bench/sequence_parallel_memory.py [--seq-len 8192] [--degrees 1 2] [--rounds 2]

Prints each rank's figures per round and the ratio of the largest rank to sp=1's. Goal:
per-rank activation memory ≈ 1/sp of sp=1's (minus what does not split: the position ids).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def worker(seq_len: int) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.sequence_parallel import apply_sequence_parallel, shard_sequences

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    sp = dist.get_world_size()
    mesh = init_device_mesh("cpu", (sp,), mesh_dim_names=("sp",))
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=258, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq_len,
                         tie_word_embeddings=False, attn_implementation="sdpa")
    model = LlamaForCausalLM(config)
    apply_sequence_parallel(model, mesh["sp"])
    tokens = torch.randint(0, 256, (1, seq_len + 1), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:],
             "position_ids": torch.arange(seq_len).unsqueeze(0)}
    batch = shard_sequences(batch, mesh["sp"])
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def step(count: dict | None) -> torch.Tensor:
        def pack(tensor: torch.Tensor) -> torch.Tensor:
            if count is not None:
                storage = tensor.untyped_storage()
                if storage.data_ptr() not in parameters:
                    count[storage.data_ptr()] = storage.nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
            loss = F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten(), reduction="sum")
        loss.backward()
        return loss

    step(None)  # warm-up: gradients exist from here on, as in training after the first step
    model.zero_grad(set_to_none=False)
    dist.barrier()
    saved: dict[int, int] = {}
    before = _status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset the high-water mark to the current RSS
    loss = step(saved)
    peak = _status_kib("VmHWM")
    total = loss.detach().clone()
    dist.all_reduce(total)
    print(json.dumps({"sp": sp, "rank": dist.get_rank(), "saved_mib": sum(saved.values()) / 2**20,
                      "peak_rss_mib": (peak - before) / 1024, "loss": float(total)}), flush=True)
    dist.destroy_process_group()


def measure(sp: int, seq_len: int) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={sp}",
               str(Path(__file__).resolve()), "--worker", "--seq-len", str(seq_len)]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    if result.returncode:
        raise SystemExit(f"sp={sp} failed:\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}")
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    return sorted(rows, key=lambda r: r["rank"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--degrees", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.seq_len)
        return
    print(f"one row of {args.seq_len} tokens, template model (hidden 256, 4 layers, 4 heads), fp32, CPU/gloo")
    for round_index in range(1, args.rounds + 1):
        reference = None
        for sp in args.degrees:
            rows = measure(sp, args.seq_len)
            saved = max(r["saved_mib"] for r in rows)
            peak = max(r["peak_rss_mib"] for r in rows)
            if reference is None:
                reference = (saved, peak)
            per_rank = ", ".join(f"rank {r['rank']}: saved {r['saved_mib']:.1f} MiB, peak RSS +{r['peak_rss_mib']:.1f} MiB"
                                 for r in rows)
            print(f"round {round_index} sp={sp}: {per_rank}; loss {rows[0]['loss']:.4f}; largest rank vs "
                  f"sp={args.degrees[0]}: saved {saved / reference[0]:.2f}x, peak RSS {peak / reference[1]:.2f}x",
                  flush=True)


if __name__ == "__main__":
    main()
