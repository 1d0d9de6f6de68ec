"""estimate_run's changes that would make a run fit (engine/estimate_changes.py): LoRA, QLoRA,
the 8-bit AdamW and CPU offload beside checkpointing, bf16, accumulation and processes, each
estimated again; and what the qlora skill and optim.name=adamw_8bit change in the estimate of a
recipe that has them. In-process on the meta device: no weights are allocated."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.config import build_config
from engine.estimate import estimate
from engine.launch import load_recipe_class
from tests.skills.skill_helpers import copy_recipe, template_with
from tests.model_families import tiny_model_folder

pytest.importorskip("bitsandbytes")
pytest.importorskip("peft")

# Llama-3.2-1B's shape: 16 layers of 2048, MLP 8192, 32 heads over 8 key/value heads, a 128k
# vocabulary with tied embeddings (1.24 B parameters).
LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True, max_position_embeddings=4096)
AT_4K = ["model.pretrained_path=models/llama-1b", "data.seq_len=4096", "data.batch_size=8", "data.source=random",
         "data.random_documents=16", "data.vocab_size=1000"]


def estimate_of(recipe: Path, overrides: list[str], nproc: int = 1, device: str = "cuda", gib: float | None = 24):
    recipe_class = load_recipe_class(recipe)
    config = build_config(recipe_class.config_class, recipe / "config.yaml", overrides)
    return estimate(recipe_class, config, nproc, device, gib)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("fit")
    folder = tiny_model_folder(root / "models" / "llama-1b", "llama")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **LLAMA_1B}))
    (folder / "model.safetensors").write_bytes(b"never read: the estimate builds the model from its config")
    copy_recipe("template", root / "plain")
    template_with(["qlora"], root / "qlora")
    template_with(["lora"], root / "lora")
    return root


@pytest.fixture
def in_workspace(workspace: Path, monkeypatch) -> Path:
    monkeypatch.chdir(workspace)
    return workspace


def test_a_1b_model_at_4k_tokens_does_not_fit_24_gib_and_lora_and_qlora_are_offered_with_their_estimates(in_workspace):
    result = estimate_of(in_workspace / "plain" / "recipe", AT_4K)
    memory = result["memory_gib"]
    assert 1.2e9 < result["params"] == result["trainable"] < 1.3e9 and result["quantized"] == 0
    assert result["optimizer"] == "AdamW"
    # Full fine-tuning in fp32: 4 + 4 + 8 bytes a parameter, about 18.5 GiB before any activation.
    assert memory["params"] + memory["grads"] + memory["optimizer"] == pytest.approx(16 * 1.236e9 / 2**30, rel=0.02)
    assert result["fits"] is False and memory["peak_gib"] > 24
    changes = {row["change"]: row for row in result["changes"]}
    kinds = {part for change in changes for part in change.split(" + ")}
    assert {"apply_skill lora", "apply_skill qlora", "optim.name=adamw_8bit", "parallel.cpu_offload=true"} <= kinds
    assert any(row["fits"] for row in result["changes"])
    lora = min((row for change, row in changes.items() if "apply_skill lora" in change), key=lambda r: r["peak_gib"])
    assert lora["peak_gib"] < memory["peak_gib"]


@pytest.mark.parametrize("skill", ["lora", "qlora"])
def test_a_change_estimated_again_matches_the_estimate_of_the_recipe_with_the_skill_applied(in_workspace, skill):
    """The row of a skill alone gives the figure the recipe with that skill applied is estimated
    at (within 5%: the change is estimated from the full model's blocks)."""
    plain = estimate_of(in_workspace / "plain" / "recipe", AT_4K, gib=4)
    row = next(r for r in plain["changes"] + _all_rows(in_workspace, AT_4K) if r["change"] == f"apply_skill {skill}")
    applied = estimate_of(in_workspace / skill / "recipe", AT_4K, gib=4)
    assert applied["memory_gib"]["peak_gib"] == pytest.approx(row["peak_gib"], rel=0.05)
    assert applied["trainable"] < plain["trainable"] / 50


def _all_rows(root: Path, overrides: list[str]) -> list[dict]:
    """Every change row (the list shown is cut to the best ones)."""
    from engine import estimate_changes

    original = estimate_changes.MAX_CHANGES
    estimate_changes.MAX_CHANGES = 10_000
    try:
        return estimate_of(root / "plain" / "recipe", overrides, gib=0.001)["changes"]
    finally:
        estimate_changes.MAX_CHANGES = original


def test_the_qlora_skill_holds_the_blocks_linear_weights_in_about_half_a_byte(in_workspace):
    plain = estimate_of(in_workspace / "plain" / "recipe", AT_4K, gib=None)
    qlora = estimate_of(in_workspace / "qlora" / "recipe", AT_4K, gib=None)
    block_linear = 16 * (2 * 2048 * 2048 + 2 * 2048 * 512 + 3 * 2048 * 8192)
    assert qlora["quantized"] == block_linear
    saved = plain["memory_gib"]["params"] - qlora["memory_gib"]["params"]
    # 4 bytes become 0.516 (4 bits, and the double-quantised scales); the adapters add a little.
    assert saved == pytest.approx(block_linear * (4 - 0.516) / 2**30, rel=0.02)
    assert qlora["optimizer"] == "AdamW" and qlora["memory_gib"]["optimizer"] < plain["memory_gib"]["optimizer"] / 50


def test_adamw_8bit_is_the_optimizer_counted_when_the_recipe_chooses_it(in_workspace):
    adamw = estimate_of(in_workspace / "plain" / "recipe", AT_4K, gib=None)
    eight_bit = estimate_of(in_workspace / "plain" / "recipe", [*AT_4K, "optim.name=adamw_8bit"], gib=None)
    assert eight_bit["optimizer"] == "AdamW8bit"
    assert eight_bit["memory_gib"]["optimizer"] == pytest.approx(adamw["memory_gib"]["optimizer"] * 2.03 / 8, rel=0.01)


def test_cpu_offload_leaves_only_activations_and_gathered_blocks_on_the_gpu(in_workspace):
    offloaded = estimate_of(in_workspace / "plain" / "recipe", [*AT_4K, "parallel.cpu_offload=true"], gib=None)
    memory = offloaded["memory_gib"]
    assert memory["params"] == memory["grads"] == memory["optimizer"] == 0
    assert memory["gathered"] > 0 and memory["activations"] > 0
