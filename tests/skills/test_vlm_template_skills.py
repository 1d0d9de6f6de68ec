"""Every skill on the vlm template (LlavaForConditionalGeneration): what applies is applied, trained
for 2 steps and its effect asserted; what does not apply says why.

The runs share ONE subprocess (``tests/skills/vlm_template_runs.py``: each variant trains in
that process under ``effect_probe``'s hooks); tensor parallelism needs two processes (torchrun).
The before/after diffs are in tests/skills/expected/<skill>--vlm.diff (test_skill_codemods.py).
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from skills import SkillRefused, apply_skill, list_skills
from tests.skills.skill_helpers import PYTHON, REPO, copy_recipe, launch, run_metrics
from tests.skills.vlm_template_runs import SMALL, VARIANTS

pytestmark = pytest.mark.slow

APPLIED = {skill for skills, _ in VARIANTS.values() for skill, _ in skills} | {"tensor-parallel"}
REFUSED = {"sequence-parallel": "passes pixel_values: a vision-language model puts each image's features at its image tokens"}
ALREADY = {"vlm-freeze-policy": "the recipe has its own stage policy: the setting `model.stage`"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    workdir = tmp_path_factory.mktemp("vlm_runs")
    result = subprocess.run(
        [PYTHON, "-m", "tests.skills.vlm_template_runs", str(workdir)],
        cwd=REPO, capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    for name, run in out.items():
        assert "error" not in run, f"{name}: {run.get('error')}"
        assert run["exit"] == 0 and len(run["records"]) == 2, f"{name}:\n{run['printed']}"
    return out


def losses(run: dict) -> list[float]:
    return [r["loss"] for r in run["records"]]


def test_every_skill_is_run_refused_or_already_there():
    assert APPLIED | set(REFUSED) | set(ALREADY) == {s.name for s in list_skills()}


@pytest.mark.parametrize("skill", sorted(REFUSED) + sorted(ALREADY))
def test_what_does_not_apply_says_why(skill: str, tmp_path: Path):
    recipe = copy_recipe("vlm", tmp_path)
    before = (recipe / "recipe.py").read_text()
    if skill in REFUSED:
        with pytest.raises(SkillRefused) as refused:
            apply_skill(skill, recipe)
        assert str(refused.value).startswith(f"{skill}: ") and REFUSED[skill] in str(refused.value)
    else:
        result = apply_skill(skill, recipe)
        assert result.already_applied and ALREADY[skill] in result.message
    assert (recipe / "recipe.py").read_text() == before


def test_checkpointing_recomputes_the_layers_of_both_towers_with_the_same_losses(runs):
    plain, checkpointed = runs["plain"], runs["gradient-checkpointing"]
    assert losses(checkpointed) == losses(plain)
    assert checkpointed["checkpointed"] == 4  # 2 vision + 2 language layers
    # An MLP inside each checkpointed layer runs again in backward: 2 steps × 2 layers more.
    for mlp in ("SiglipMLP", "LlamaMLP"):
        assert checkpointed["forwards"][mlp] - plain["forwards"][mlp] == 2 * 2, mlp
    # Through the model's own switch: both towers' layers, no wrappers (FSDP2 shards the layers).
    assert checkpointed["applied"][0]["acts_on"].startswith("turns on LlavaForConditionalGeneration's own")
    assert checkpointed["warnings"] == []


def test_freeze_parts_keeps_the_projector_bit_identical(runs):
    run = runs["freeze"]
    assert re.fullmatch(r"freezes the projector of LlavaForConditionalGeneration \(the recipe also sets "
                        r"requires_grad at recipe\.py:\d+: the run prints how many values this newly froze\)",
                        run["applied"][0]["acts_on"])
    sizes = run["sizes"]
    assert run["frozen"] == sizes["projector"] and run["frozen_changed"] == [] and run["trainable_changed"] > 0
    assert f"freeze: froze {sizes['projector']:,} of {sizes['total']:,} parameter values" in run["printed"]


def test_freezing_what_the_stage_policy_froze_says_nothing_new_was_frozen(runs):
    run = runs["freeze-frozen"]
    sizes = run["sizes"]
    assert f"freeze: nothing new frozen: the {sizes['vision_tower']:,} parameter values chosen" in run["printed"]
    assert "freeze: froze" not in run["printed"]


def test_lora_trains_only_the_adapters_of_the_language_model(runs):
    run = runs["lora"]
    assert "in the layers of the language model of" in run["applied"][0]["acts_on"]
    assert run["lora_layers"] == 2 * 7  # Llama's 7 linear layers a block; none of SigLIP's (q_proj, ... too)
    assert "lora: adapted 14 linear layers (down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj) of " \
        "`model.language_model` of LlavaForConditionalGeneration" in run["printed"]
    assert run["frozen_changed"] == [] and run["trainable_changed"] > 0
    assert run["trainable"] < run["frozen"] / 10


def test_qlora_quantises_the_layers_of_both_towers_and_trains_the_adapters(runs):
    run = runs["qlora"]
    assert re.search(r"qlora: quantised \d+ linear layers of \w+ to 4-bit nf4", run["printed"]), run["printed"]
    assert "lora: adapted" in run["printed"]
    assert losses(run) != losses(runs["lora"])  # the base weights are 4-bit


def test_packing_image_text_samples_cuts_padding(runs):
    plain, packed = runs["plain-files"], runs["sequence-packing"]
    assert max(r["padding_frac"] for r in packed["records"]) < min(r["padding_frac"] for r in plain["records"])
    assert "image+text samples" in packed["applied"][0]["acts_on"]


def test_mixed_precision_runs_the_forward_in_bfloat16(runs):
    run = runs["mixed-precision"]
    assert run["autocast_forwards"] > 0 and run["bfloat16_outputs"] > 0
    assert losses(run) != losses(runs["plain"])  # bfloat16 rounds
    assert losses(run) == pytest.approx(losses(runs["plain"]), rel=1e-2)


def test_torch_compile_compiles_the_layers_of_both_towers(runs):
    run = runs["torch-compile"]
    assert run["compiled"] == 4 and run["graphs"] > 0  # the blocks FSDP2 shards: 2 SigLIP and 2 Llama layers
    assert "torch-compile: compiled 4 blocks of" in run["printed"]
    assert losses(run) == pytest.approx(losses(runs["plain"]), rel=1e-5)


def test_muon_steps_the_matrices(runs):
    run = runs["muon"]
    assert run["optimizer"] == "MuonWithAdamW" and run["muon_matrices_stepped"] > 0


def test_gpu_kernels_stay_off_on_cpu_and_the_guard_passes_every_step(runs):
    run = runs["guards"]
    assert losses(run) == losses(runs["plain"])
    assert run["guard_good_steps"] == 2
    assert any(w.startswith("liger-kernel: no CUDA GPU") for w in run["warnings"])
    assert any(w.startswith("flash-attention: no CUDA GPU") for w in run["warnings"])


@pytest.mark.multiprocess
def test_tensor_parallel_shards_the_language_model_over_two_processes(runs, tmp_path: Path):
    recipe = copy_recipe("vlm", tmp_path)
    apply_skill("tensor-parallel", recipe)
    result = launch(recipe, tmp_path, *SMALL, "parallel.tp=2", nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "tensor-parallel:" in result.stdout
    assert [r["loss"] for r in run_metrics(tmp_path)] == pytest.approx(losses(runs["plain"]), rel=1e-4)
