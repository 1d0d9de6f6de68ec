"""muon, proven by runs and by the written optimizer itself:

- the template trains with Muon on CPU, and its optimizer holds Muon for the blocks' 2-D weights
  and AdamW for embeddings, head and norms;
- one step of ``MuonWithAdamW`` is torch.optim.Muon (``adjust_lr_fn="match_rms_adamw"``) on the
  matrices plus torch.optim.AdamW on the rest, bit for bit;
- two FSDP2 processes (each matrix gathered before Newton-Schulz) match one process;
- at a tuned learning rate each (the lrs from bench/muon_vs_adamw.py's 150-step sweep), Muon is
  lower than AdamW after 30 steps, in training and evaluation loss.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import math
import os
import subprocess
from pathlib import Path

import pytest
import torch

from engine import run_checkpoints
from tests.skills.skill_helpers import (
    PYTHON,
    REPO,
    SMALL_RUN,
    initial_template_model,
    load_recipe_module,
    on_documents,
    run_dir,
    run_metrics,
    template_with,
    train,
)

STEPS = ("train.max_steps=6", "optim.lr=1e-2")


def parameter_names(model, params) -> set[str]:
    names = {id(p): name for name, p in model.named_parameters()}
    return {names[id(p)] for p in params}


def test_muon_holds_the_block_matrices_and_adamw_the_rest(tmp_path: Path):
    recipe = template_with(["muon"], tmp_path / "muon")
    module = load_recipe_module(recipe)
    model = initial_template_model(recipe)

    optimizer = module.MuonWithAdamW(model, lr=1e-3)

    groups = {g["algorithm"]: parameter_names(model, g["params"]) for g in optimizer.param_groups}
    matrices = {f"model.layers.{i}.{m}.weight" for i in range(2) for m in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    assert groups["muon"] == matrices
    assert groups["adamw"] == {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"} | {
        f"model.layers.{i}.{n}.weight" for i in range(2) for n in ("input_layernorm", "post_attention_layernorm")}


def test_frozen_parameters_stay_out_of_both_groups(tmp_path: Path):
    module = load_recipe_module(template_with(["muon"], tmp_path / "muon"))
    model = initial_template_model(template_with([], tmp_path / "plain"))
    model.model.embed_tokens.weight.requires_grad_(False)
    model.model.layers[0].self_attn.q_proj.weight.requires_grad_(False)

    optimizer = module.MuonWithAdamW(model)

    held = parameter_names(model, [p for g in optimizer.param_groups for p in g["params"]])
    assert "model.embed_tokens.weight" not in held and "model.layers.0.self_attn.q_proj.weight" not in held
    assert len(held) == sum(1 for p in model.parameters() if p.requires_grad)


def test_one_step_equals_torch_muon_on_the_matrices_and_adamw_on_the_rest(tmp_path: Path):
    if not hasattr(torch.optim, "Muon"):
        pytest.skip("torch.optim.Muon is not in this torch (2.9+)")
    module = load_recipe_module(template_with(["muon"], tmp_path / "muon"))
    model = initial_template_model(template_with([], tmp_path / "plain"))
    reference = copy.deepcopy(model)
    settings = dict(lr=2e-2, weight_decay=0.1)
    ours = module.MuonWithAdamW(model, betas=(0.9, 0.95), momentum=0.95, nesterov=True, ns_steps=5, **settings)
    matrices = [p for g in ours.param_groups if g["algorithm"] == "muon" for p in g["params"]]
    names = parameter_names(model, matrices)
    reference_matrices = [p for n, p in reference.named_parameters() if n in names]
    reference_rest = [p for n, p in reference.named_parameters() if n not in names]
    muon = torch.optim.Muon(reference_matrices, momentum=0.95, nesterov=True, ns_steps=5,
                            adjust_lr_fn="match_rms_adamw", **settings)
    adamw = torch.optim.AdamW(reference_rest, betas=(0.9, 0.95), foreach=False, **settings)
    batch = torch.randint(0, 256, (2, 33))

    for _ in range(3):
        for net, optimizers in ((model, [ours]), (reference, [muon, adamw])):
            out = net(input_ids=batch[:, :-1], labels=batch[:, 1:], use_cache=False)
            out.loss.backward()
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad()

    for (name, a), (_, b) in zip(model.named_parameters(), reference.named_parameters()):
        assert torch.equal(a, b), name


def test_newton_schulz_orthogonalizes(tmp_path: Path):
    module = load_recipe_module(template_with(["muon"], tmp_path / "muon"))
    matrix = torch.randn(96, 40, generator=torch.Generator().manual_seed(0))

    result = module.newton_schulz(matrix, 5).float()

    singular_values = torch.linalg.svdvals(result)
    assert result.shape == matrix.shape
    assert 0.5 < singular_values.min() and singular_values.max() < 1.3  # U S' Vᵀ with S' near 1


def test_template_trains_with_muon_and_the_run_records_no_warning(tmp_path: Path, documents: Path, capsys):
    records = train(template_with(["muon"], tmp_path / "muon"), tmp_path / "run", *STEPS, *on_documents(documents))

    losses = [r["loss"] for r in records]
    with capsys.disabled():
        print(f"\n[muon] template, 6 steps at lr 1e-2: loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0] - 0.5
    warnings = json.loads((run_dir(tmp_path / "run") / "run.json").read_text()).get("warnings", [])
    # Variable-length documents: the run suggests sequence-packing; muon itself warns of nothing.
    assert [w for w in warnings if "the sequence-packing skill" not in w] == []


def resume(recipe: Path, cwd: Path, checkpoint: Path, *settings: str) -> list[dict]:
    """Continue a run from ``checkpoint`` in a new run under ``cwd``; its logged step records."""
    cwd.mkdir(parents=True)
    sets = [a for s in (*SMALL_RUN, *settings) for a in ("--set", s)]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    command = [PYTHON, "-m", "engine.launch", str(recipe), *sets, "--resume-from", str(checkpoint)]
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return run_metrics(cwd)


def test_a_resumed_muon_run_continues_bit_identically(tmp_path: Path, documents: Path):
    recipe = template_with(["muon"], tmp_path / "muon")
    settings = (*STEPS, *on_documents(documents), "checkpoint.every=3")
    whole = train(recipe, tmp_path / "whole", *settings)
    step, checkpoint = run_checkpoints.list_checkpoints(run_dir(tmp_path / "whole"))[0]

    resumed = resume(recipe, tmp_path / "resumed", checkpoint, *settings)

    assert step == 3
    assert [r["loss"] for r in resumed] == [r["loss"] for r in whole[3:]]


@pytest.mark.multiprocess
def test_two_fsdp_processes_match_one_process_and_resume_on_one(tmp_path: Path, documents: Path, capsys):
    recipe = template_with(["muon"], tmp_path / "muon")
    data = (*on_documents(documents), "checkpoint.every=3")
    sharded = ("parallel.fsdp_on_one_process=true",)

    one = train(recipe, tmp_path / "one", *STEPS, *data, *sharded)
    two = train(recipe, tmp_path / "two", *STEPS, *data, nproc=2)
    _, checkpoint = run_checkpoints.list_checkpoints(run_dir(tmp_path / "two"))[0]
    resharded = resume(recipe, tmp_path / "resharded", checkpoint, *STEPS, *data)

    differences = [abs(a["loss"] - b["loss"]) for a, b in zip(one, two)]
    resume_differences = [abs(a["loss"] - b["loss"]) for a, b in zip(two[3:], resharded)]
    with capsys.disabled():
        print(f"\n[muon] FSDP2 2 processes vs 1, {len(one)} steps: max |loss diff| {max(differences):.2e}; "
              f"resumed on 1 from 2: {max(resume_differences):.2e}")
    assert len(one) == len(two) == 6 and len(resharded) == 3
    assert max(differences) < 1e-3
    assert max(resume_differences) < 1e-3


# The best learning rates of `python bench/muon_vs_adamw.py` (AdamW: 3e-4, 1e-3, 3e-3, 1e-2;
# Muon: 3e-3, 1e-2, 3e-2), at its settings: the template's model, 150 steps, seed 0. The test runs
# the first 30 of those steps (about 35 s instead of 250 s on 2 cores; the README's figures are the
# bench's 150): there Muon's losses were 0.86x AdamW's (final 2.57 vs 2.98, eval 2.48 vs 2.91).
MUON_LR, ADAMW_LR, TEST_STEPS = 1e-2, 1e-3, 30


@pytest.mark.slow
def test_muon_ends_lower_than_adamw_at_their_tuned_learning_rates(capsys):
    command = [PYTHON, str(REPO / "bench" / "muon_vs_adamw.py"), "--steps", str(TEST_STEPS),
               "--adamw-lrs", str(ADAMW_LR), "--muon-lrs", str(MUON_LR)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)

    assert result.returncode == 0, result.stderr[-2000:]
    best = json.loads(result.stdout.strip().splitlines()[-1])["best"]
    with capsys.disabled():
        print(f"\n[muon] {TEST_STEPS} steps: AdamW (lr {ADAMW_LR}) final {best['adamw']['final_loss']:.4f} eval "
              f"{best['adamw']['eval_loss']:.4f}; Muon (lr {MUON_LR}) final {best['muon']['final_loss']:.4f} eval "
              f"{best['muon']['eval_loss']:.4f}")
    assert best["muon"]["final_loss"] < best["adamw"]["final_loss"]
    assert best["muon"]["eval_loss"] < best["adamw"]["eval_loss"]


def test_the_triton_variant_imports_and_orthogonalizes_on_a_cpu(tmp_path: Path):
    module = load_recipe_module(template_with(["muon"], tmp_path / "muon", params={"muon": {"triton": True}}))
    matrix = torch.randn(48, 80, generator=torch.Generator().manual_seed(0))

    assert torch.equal(module.newton_schulz(matrix, 5), module.newton_schulz_torch(matrix, 5))  # no GPU: torch's


INTERPRETED_KERNEL = """
import sys, torch
sys.path.insert(0, {repo!r})
from tests.skills.skill_helpers import load_recipe_module
from pathlib import Path
module = load_recipe_module(Path({recipe!r}))
kernel = module.symmetric_matmul_kernel
kernel.configs = [c for c in kernel.configs if c.kwargs["BLOCK"] == 64][:1]  # one: no timing on a CPU
torch.manual_seed(0)
x = torch.randn(100, 70)  # not a multiple of the tiles: the masks matter
gram = torch.empty(100, 100)
module.symmetric_matmul(x, gram)
out = torch.empty(100, 100)
module.symmetric_matmul(gram, out, alpha=2.0, beta=-3.0, add=gram)
print((gram - x @ x.T).abs().max().item(), (out - (2.0 * gram @ gram.T - 3.0 * gram)).abs().max().item())
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs the triton package")
def test_the_symmetric_matmul_kernel_is_right_in_tritons_interpreter(tmp_path: Path):
    """Triton's CPU interpreter (float32: it mishandles bfloat16) runs the kernel's tiles,
    masks and mirrored stores; speed and bfloat16 are for tests/skills/test_gpu_kernels.py."""
    recipe = template_with(["muon"], tmp_path / "muon", params={"muon": {"triton": True}})
    script = INTERPRETED_KERNEL.format(repo=str(REPO), recipe=str(recipe))
    env = dict(os.environ, TRITON_INTERPRET="1")

    result = subprocess.run([PYTHON, "-c", script], capture_output=True, text=True, env=env, timeout=600)

    assert result.returncode == 0, result.stderr[-3000:]
    gram_gap, polynomial_gap = (float(x) for x in result.stdout.split())
    assert gram_gap < 1e-3 and polynomial_gap < 1e-1  # float32 sums of ~70 and ~100 products
