"""optim.name=adamw_8bit (bitsandbytes' AdamW8bit) and parallel.cpu_offload (FSDP2's
CPUOffloadPolicy): what each does to a run, and the runs each is refused for."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.config import ConfigError, OptimConfig, ParallelConfig
from engine.distributed import DistInfo
from engine.fsdp import apply_fsdp
from engine.optimizers import adamw_8bit, check_optimizer_choice, is_8bit
from tests.skills.skill_helpers import load_checkpoint
from tests.support import TINY, copy_template, losses, run_engine

SHORT = ("train.max_steps=6", "checkpoint.every=0", "checkpoint.at_end=true", "metrics.tensorboard=false",
         "data.source=random", "data.vocab_size=64", "data.random_documents=64")


def test_adamw_8bit_keeps_its_states_in_8_bits_and_trains(tmp_path: Path):
    pytest.importorskip("bitsandbytes")
    recipe = copy_template(tmp_path)
    run = run_engine(tmp_path, recipe, *TINY, *SHORT, "optim.name=adamw_8bit")
    curve = losses(run)
    assert sorted(curve) == [1, 2, 3, 4, 5, 6] and curve[6] < curve[1]
    (checkpoint,) = sorted((run / "checkpoints").glob("step-*"))
    states = load_checkpoint(checkpoint, tmp_path)["model_optim"]["optim"]["state"]
    # A 2-D weight's two states are 8-bit, with a float32 scale per block of 256 values.
    weight = states["model.layers.0.mlp.up_proj.weight"]["__bnb_optimizer_quant_state__"]
    assert weight["state1"].dtype == weight["state2"].dtype == torch.uint8
    assert weight["absmax1"].dtype == torch.float32


def test_adamw_8bit_is_an_8bit_optimizer_and_adamw_is_not():
    pytest.importorskip("bitsandbytes")
    params = [torch.nn.Parameter(torch.zeros(4, 4))]
    assert is_8bit(adamw_8bit(params, OptimConfig(name="adamw_8bit")))
    assert not is_8bit(torch.optim.AdamW(params))


def test_a_recipe_that_builds_another_optimizer_for_adamw_8bit_is_refused():
    params = [torch.nn.Parameter(torch.zeros(4, 4))]
    with pytest.raises(ConfigError, match="optim.name=adamw_8bit but prepare_optimizer\\(\\) built AdamW; "):
        check_optimizer_choice(OptimConfig(name="adamw_8bit"), torch.optim.AdamW(params))
    check_optimizer_choice(OptimConfig(), torch.optim.AdamW(params))  # the default asks for nothing more


def test_cpu_offload_on_a_cpu_is_refused_and_the_model_is_left_as_it_was():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    before = [type(p) for p in model.parameters()]
    with pytest.raises(ConfigError) as refused:
        apply_fsdp(model, DistInfo(0, 1, 0, torch.device("cpu"), None), ParallelConfig(cpu_offload=True))
    assert str(refused.value) == (
        "parallel.cpu_offload keeps the weights in host memory while a GPU computes; this run computes on cpu, "
        "where they are in host memory already: set parallel.cpu_offload=false")
    assert [type(p) for p in model.parameters()] == before


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cpu_offload_trains_on_a_gpu_with_the_same_losses(tmp_path: Path):
    recipe = copy_template(tmp_path)
    plain = losses(run_engine(tmp_path, recipe, *TINY, *SHORT, "parallel.fsdp_on_one_process=true"))
    offloaded = losses(run_engine(tmp_path, recipe, *TINY, *SHORT, "parallel.cpu_offload=true"))
    # The optimizer steps on the host (CPU AdamW) instead of the GPU: the same losses up to rounding.
    assert offloaded == pytest.approx(plain, rel=1e-4)
