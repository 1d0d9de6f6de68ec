"""Sequence parallelism (engine/sequence_parallel.py): the attention on 2 processes against the
whole-sequence model, the batch split, and the launch check of parallel.sp."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.config import ConfigError, build_config
from engine.sequence_parallel import shard_sequences

REPO = Path(__file__).resolve().parents[2]
PROBE = Path(__file__).with_name("sequence_parallel_probe.py")
TEMPLATE = REPO / "recipes_template" / "causal_lm"


@pytest.mark.multiprocess
def test_two_sequence_parallel_ranks_give_the_loss_and_gradients_of_the_whole_sequence(capsys):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(PROBE)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    cases = {c["case"]: c for c in map(json.loads, (line for line in result.stdout.splitlines() if line.startswith("{")))}
    with capsys.disabled():
        for c in (c for c in cases.values() if "loss_diff" in c):
            print(f"\n[sequence-parallel] sp=2 vs whole sequence, {c['case']}: relative |loss diff| "
                  f"{c['loss_diff']:.1e}, max |grad diff| {c['grad_diff']:.1e}")

    # Without position ids, each rank's part gets its global positions (RoPE), as a whole row would.
    for name in ("causal", "packed", "kv_heads_below_sp", "without_position_ids"):
        assert cases[name]["loss_diff"] < 1e-6 and cases[name]["grad_diff"] < 1e-4, cases[name]
    # The control: packed documents attending to each other give another loss, so the packed
    # case above is sensitive to the per-document mask.
    assert cases["packed_without_document_mask"]["loss_diff"] > 1e-4
    assert cases["packed_without_document_mask"]["grad_diff"] > 1e-2
    assert cases["attention_mask"]["refusal"] == (
        "sequence parallel: the forward passes attention_mask, which cannot be split with the sequence; "
        "pass position_ids (padding after the real tokens needs no mask)"
    )


class _Mesh:
    def __init__(self, size: int, rank: int):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def get_local_rank(self) -> int:
        return self._rank


def test_each_rank_keeps_its_contiguous_part_of_every_sequence_with_global_positions():
    batch = {
        "input_ids": torch.arange(16).reshape(2, 8),
        "labels": torch.arange(100, 116).reshape(2, 8),
        "position_ids": torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7], [0, 1, 2, 0, 1, 2, 3, 4]]),
        "weights": torch.ones(2),
    }
    parts = [shard_sequences(batch, _Mesh(2, rank)) for rank in (0, 1)]

    assert parts[1]["input_ids"].tolist() == [[4, 5, 6, 7], [12, 13, 14, 15]]
    assert parts[1]["position_ids"].tolist() == [[4, 5, 6, 7], [1, 2, 3, 4]]
    for key in ("input_ids", "labels", "position_ids"):
        assert torch.equal(torch.cat([parts[0][key], parts[1][key]], dim=1), batch[key])
    assert parts[0]["weights"] is batch["weights"]
    assert shard_sequences(batch, _Mesh(1, 0)) is batch
    with pytest.raises(ConfigError, match=r"batch\['input_ids'\] has 8 positions, which do not divide by parallel.sp=3"):
        shard_sequences(batch, _Mesh(3, 0))


LAUNCH_CHECKS = [
    ((4, "parallel.sp=3"), "parallel.sp=3 does not divide the number of processes (4)"),
    ((4, "parallel.sp=2", "parallel.tp=2"), "sequence and tensor parallelism together are not supported"),
    ((2, "parallel.sp=2", "data.seq_len=127"), "data.seq_len=127 must be a multiple of parallel.sp=2"),
    ((4, "parallel.sp=4", "model.num_heads=6", "model.num_kv_heads=2"),
     "the 6 attention heads of model.num_heads do not divide by parallel.sp=4"),
    ((4, "parallel.sp=2", "data.batch_size=3"), "data.batch_size=3 must be a multiple of data-parallel ranks"),
]


def test_the_launch_check_refuses_what_sequence_parallel_cannot_split():
    from engine.launch import load_recipe_class

    recipe_class = load_recipe_class(TEMPLATE)
    for (world, *overrides), message in LAUNCH_CHECKS:
        config = build_config(recipe_class.config_class, None, overrides)
        with pytest.raises(ConfigError) as refusal:
            recipe_class.validate_config(config, world)
        assert message in str(refusal.value), (overrides, str(refusal.value))
    # 4 processes with sp=2: 2 data-parallel ranks of 2 sequence-parallel ranks each.
    recipe_class.validate_config(build_config(recipe_class.config_class, None, ["parallel.sp=2"]), 4)
