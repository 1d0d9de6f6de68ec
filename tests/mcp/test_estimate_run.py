"""estimate_run: memory and step time per process before a run, from the model on the meta device.

Real runs check the estimate against the peak RSS they measure (a looser bound than the 15% that
bench/estimate_memory.py prints per template and size), and that gradient checkpointing moves the
estimate the way it moves the measurement; a model too large for 8 GiB gets changes that fit.
"""

from __future__ import annotations

import json

import pytest

from engine.errors import BadInput
from mcp_server import cli
from mcp_server.arguments import EstimateArgs
from mcp_server.operations import estimate
from mcp_server.operations import recipes as recipe_ops
from mcp_server.operations import launch as launching
from mcp_server.operations import runs as run_ops
from workspace.workspace import Workspace
from tests.support import finished_run

# Weights and activations well above the process floor (torch and the data: about 450 MB).
MEDIUM = ["model.hidden_size=256", "model.intermediate_size=688", "model.num_layers=4", "data.seq_len=256",
          "data.batch_size=8", "train.max_steps=3", "train.log_every=1", "checkpoint.every=0",
          "checkpoint.at_end=false", "metrics.tensorboard=false"]
TOO_LARGE = {"model.hidden_size": 2048, "model.intermediate_size": 5504, "model.num_layers": 24,
             "model.num_heads": 16, "model.num_kv_heads": 8, "data.seq_len": 2048, "data.batch_size": 8}
TOLERANCE = 0.25


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Workspace:
    ws = Workspace.open(tmp_path_factory.mktemp("estimate"))
    recipe_ops.scaffold_recipe(ws, "causal_lm", "plain")
    recipe_ops.scaffold_recipe(ws, "causal_lm", "ckpt", skills=["gradient-checkpointing"])
    recipe_ops.scaffold_recipe(ws, "sft", "chat")
    recipe_ops.scaffold_recipe(ws, "vlm", "captions")
    return ws


def measured_peak_mb(ws: Workspace, recipe: str, overrides: list[str]) -> float:
    run_id = finished_run(ws, launching.launch_run(ws, recipe, 1, overrides).run_id)
    return max(r["peak_mem_mb"] for r in run_ops.tail_metrics(ws, run_id, 200).records if "peak_mem_mb" in r)


def peak_mb(result) -> float:
    return result.estimate["memory_gib"]["peak_gib"] * 1024


def test_the_parameters_are_the_models_own(ws):
    from transformers import LlamaConfig, LlamaForCausalLM

    result = estimate.estimate_run(ws, "recipes/plain", MEDIUM)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=258, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False))
    assert result.estimate["params"] == result.estimate["trainable"] == model.num_parameters()
    assert result.fits is None and result.changes == []
    assert result.estimate["checkpointed_blocks"] == "0 of 4"


@pytest.mark.parametrize("family", ["qwen2", "llama", "gemma2"])
def test_a_model_the_recipe_loads_from_a_folder_is_built_from_its_config_without_its_weights(ws, family):
    import transformers
    from tests.model_families import tiny_model_folder

    folder = tiny_model_folder(ws.root / "models" / family, family, hidden_size=64, intermediate_size=128)
    expected = transformers.AutoModelForCausalLM.from_pretrained(folder).num_parameters()
    (folder / "model.safetensors").write_bytes(b"not weights")  # never read: the estimate needs the config only
    result = estimate.estimate_run(ws, "recipes/chat", [f"model.pretrained_path=models/{family}", "data.seq_len=64"])
    assert result.estimate["params"] == result.estimate["trainable"] == expected
    assert result.estimate["memory_gib"]["activations"] > 0


def test_the_estimate_is_at_data_seq_len_though_the_data_is_shorter(ws):
    """The sft collator pads a batch to its longest example; the data's examples are far shorter
    than data.seq_len, and the estimate is still at data.seq_len (the longest batch the run can
    see), saying so."""
    short, long = (estimate.estimate_run(ws, "recipes/chat", [f"data.seq_len={n}"]) for n in (256, 1024))
    assert long.estimate["memory_gib"]["activations"] > 3 * short.estimate["memory_gib"]["activations"]
    assert "measured at 1,024 tokens per row (data.seq_len)" in long.estimate["activations_source"]
    assert "this data's first batch is" in long.estimate["activations_source"]


@pytest.mark.slow
def test_the_estimate_of_a_model_from_a_folder_is_near_the_measured_peak_rss(ws):
    from tests.model_families import tiny_model_folder

    tiny_model_folder(ws.root / "models" / "medium", "qwen2", hidden_size=256, intermediate_size=688,
                      num_hidden_layers=4)
    overrides = [*MEDIUM, "model.pretrained_path=models/medium"]
    estimated = peak_mb(estimate.estimate_run(ws, "recipes/chat", overrides))
    measured = measured_peak_mb(ws, "recipes/chat", overrides)
    print(f"\nqwen2 from a folder: estimated {estimated:,.0f} MB, measured {measured:,.0f} MB ({estimated / measured:.2f})")
    assert abs(estimated / measured - 1) < TOLERANCE


@pytest.mark.slow
@pytest.mark.parametrize("recipe, shape", [
    ("recipes/plain", []), ("recipes/chat", []), ("recipes/captions", ["data.seq_len=64", "data.batch_size=16"]),
])
def test_the_estimated_peak_is_near_the_measured_peak_rss(ws, recipe, shape):
    overrides = [*MEDIUM, *shape]
    estimated, measured = peak_mb(estimate.estimate_run(ws, recipe, overrides)), measured_peak_mb(ws, recipe, overrides)
    print(f"\n{recipe}: estimated {estimated:,.0f} MB, measured {measured:,.0f} MB ({estimated / measured:.2f})")
    assert abs(estimated / measured - 1) < TOLERANCE


@pytest.mark.slow
def test_gradient_checkpointing_moves_the_estimate_as_it_moves_the_measurement(ws, monkeypatch):
    # The resident set follows the live bytes (engine/memory.py), in the estimate and in both runs:
    # what glibc's dynamic threshold keeps of freed activations varies run to run (the same two runs
    # measured -79 to -105 MB apart, against -51 MB estimated with HEAP_KEPT_CHECKPOINTED's average
    # share), and bench/estimate_memory.py measures that share; here the checkpointing rule alone.
    monkeypatch.setenv("TRAINWRIGHT_MMAP_THRESHOLD", "262144")
    monkeypatch.setenv("TRAINWRIGHT_PASS_ENV", "TRAINWRIGHT_MMAP_THRESHOLD")
    plain, ckpt = (estimate.estimate_run(ws, r, MEDIUM) for r in ("recipes/plain", "recipes/ckpt"))
    assert ckpt.estimate["checkpointed_blocks"] == "4 of 4"
    assert ckpt.estimate["memory_gib"]["activations"] < plain.estimate["memory_gib"]["activations"]
    assert ckpt.estimate["params"] == plain.estimate["params"]
    estimated = peak_mb(ckpt) - peak_mb(plain)
    measured = measured_peak_mb(ws, "recipes/ckpt", MEDIUM) - measured_peak_mb(ws, "recipes/plain", MEDIUM)
    print(f"\ncheckpointing: estimated {estimated:+,.0f} MB, measured {measured:+,.0f} MB")
    assert estimated < 0 and measured < 0
    assert 0.8 < estimated / measured < 1.25  # -106 against -106 and -107 MB


def test_a_model_too_large_for_8_gib_does_not_fit_and_gets_changes_that_do(ws):
    result = estimate.estimate_run(ws, "recipes/plain", TOO_LARGE, device="cuda", device_memory_gib=8)
    assert result.fits is False
    assert result.estimate["memory_gib"]["floor"] == 0  # a GPU's allocated memory has no process floor
    assert result.estimate["params"] > 10**9
    fitting = [c for c in result.changes if c["fits"]]
    assert fitting and result.changes[: len(fitting)] == fitting  # those that fit come first
    assert all(c["peak_gib"] <= 8 for c in fitting) and all(c["peak_gib"] > 8 for c in result.changes[len(fitting):])
    # Each is estimated again: the estimate of the run with that change made gives its figure (within
    # 5%: the change is estimated from blocks measured without checkpointing).
    change = next(c for c in fitting if c["change"] == "apply_skill gradient-checkpointing + nproc=8")
    again = estimate.estimate_run(ws, "recipes/ckpt", TOO_LARGE, nproc=8, device="cuda", device_memory_gib=8)
    assert again.fits is True
    assert again.estimate["memory_gib"]["peak_gib"] == pytest.approx(change["peak_gib"], rel=0.05)


@pytest.mark.parametrize("arguments, message", [
    ({"device": "tpu"}, "device: Input should be 'cpu' or 'cuda'"),
    ({"device_memory_gib": -1}, "device_memory_gib must be a number of GiB above 0, got -1.0"),
    ({"nproc": 0}, "nproc must be between 1 and"),
])
def test_bad_input_says_what_to_change(arguments, message):
    """Checked where estimate_run's arguments are declared (EstimateArgs), as over MCP and the CLI."""
    with pytest.raises(BadInput, match=message.replace("(", r"\(").replace(")", r"\)")):
        EstimateArgs.checked(recipe="recipes/plain", **arguments)


def test_the_cli_twin_prints_it(ws, capsys):
    code = cli.main(["estimate", "recipes/plain", "--device", "cuda", "--device-memory-gib", "8", "--workspace",
                     str(ws.root), "--json", *(a for k, v in TOO_LARGE.items() for a in ("--set", f"{k}={v}"))])
    printed = json.loads(capsys.readouterr().out)
    assert code == 0 and printed["fits"] is False and printed["changes"]
    assert len(json.dumps(printed)) < 8_000
    cli.main(["estimate", "recipes/plain", "--workspace", str(ws.root), "--set", "model.num_layers=2"])
    text = capsys.readouterr().out
    assert text.startswith("recipes/plain on 1 × cpu, per process:\n  parameters  ")
    assert "step time" in text and "matmul probe here" in text
