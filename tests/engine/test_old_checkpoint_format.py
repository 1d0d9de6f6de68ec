"""A checkpoint saved before ``loss_tokens_seen`` existed (its train state: step and tokens_seen,
which then counted the loss's tokens) resumes, and is not called corrupt: DCP loads only the keys
a state names and refuses one the checkpoint lacks, so the engine leaves that key out when the
verified checkpoint has none."""

from __future__ import annotations

import shutil

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp

from engine import run_dir as rd
from engine import run_checkpoints
from engine import run_metrics
from engine.checkpoint_manifest import write_manifest
from tests.support import TEMPLATE, TINY, run_engine

SCHEDULE = [*TINY, "train.max_steps=4", "checkpoint.every=2", "data.source=random"]


def test_a_checkpoint_without_loss_tokens_seen_resumes_with_its_tokens_seen_as_that_count(tmp_path):
    recipe = shutil.copytree(TEMPLATE, tmp_path / "lm")
    first = run_engine(tmp_path, recipe, *SCHEDULE)
    checkpoint = first / rd.CHECKPOINTS_DIRNAME / run_checkpoints.checkpoint_dir_name(2)
    whole = tmp_path / "whole.pt"
    dcp_to_torch_save(str(checkpoint), str(whole))
    state = torch.load(whole, weights_only=False)
    seen_then = state["train"]["loss_tokens_seen"]
    del state["train"]["loss_tokens_seen"]  # the format before it existed
    state["train"]["tokens_seen"] = seen_then
    torch.save(state, whole)
    shutil.rmtree(checkpoint)
    torch_save_to_dcp(str(whole), str(checkpoint))
    write_manifest(checkpoint)

    resumed = run_engine(tmp_path, recipe, *SCHEDULE, resume_from=checkpoint)

    assert rd.read_run(resumed).status == rd.COMPLETED
    records = [r for r in run_metrics.read_all_metrics(resumed / rd.METRICS_JSONL) if "loss_tokens_seen" in r]
    original = {r["step"]: r for r in run_metrics.read_all_metrics(first / rd.METRICS_JSONL) if "loss_tokens_seen" in r}
    assert [r["step"] for r in records] == [3, 4]
    assert [r["loss_tokens_seen"] for r in records] == [original[3]["loss_tokens_seen"], original[4]["loss_tokens_seen"]]
