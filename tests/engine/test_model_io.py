"""Models out and in: a checkpoint exported as a Hugging Face folder is the same model.

Two short runs of the template on a small corpus (one plain, one with the lora skill), shared
by every test; the exports, loads and comparisons run in this process (``engine.model_io``'s
functions, without the sandbox that the tools add; tests/mcp/test_model_tools.py goes through
it). Printed figures: ``pytest -s tests/engine/test_model_io.py``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from engine import run_dir as rd
from engine import run_checkpoints
from engine import run_metrics
from engine import model_io
from engine.distributed import DistInfo
from engine.seams import ExportOutcome
from tests.support import TINY, copy_template, engine_command, engine_env, new_run_dirs

pytestmark = pytest.mark.slow

RUN = (*TINY, "train.max_steps=4", "checkpoint.every=2", "train.eval_every=2",
       "train.eval_batches=2", "data.eval_fraction=0.2", "metrics.tensorboard=false")
TEXT = "def f(x):\n    return 'héllo wörld' + str(x)  # ✓\n"


def write_corpus(path: Path) -> None:
    words = "the model reads bytes and writes them back while the loss falls slowly".split()
    with open(path, "w") as f:
        for i in range(120):
            f.write(json.dumps({"text": " ".join(words[(i + k) % len(words)] for k in range(20 + i % 30))}) + "\n")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(plain run, LoRA run): each trained 4 steps, with its recipe as the run's code snapshot."""
    from tests.skills.skill_helpers import template_with

    torch.set_num_threads(1)  # the runs compute with one thread: the same sums here
    workspace = tmp_path_factory.mktemp("model-io")
    write_corpus(workspace / "corpus.jsonl")
    recipes = [copy_template(workspace, "lm"), template_with(["lora"], workspace / "lora", {"lora": {"rank": 4}})]
    corpus = f"data.paths=[{workspace / 'corpus.jsonl'}]"  # absolute: the tests read it from elsewhere
    started = []
    for recipe in recipes:  # at once, each in a folder of its own (its runs/ holds only its run)
        cwd = recipe.parent / f"{recipe.name}-cwd"
        cwd.mkdir()
        process = subprocess.Popen(engine_command(recipe, *RUN, corpus, "optim.lr=1e-2"), cwd=cwd, env=engine_env(),
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        started.append((recipe, cwd, process))
    found = []
    for recipe, cwd, process in started:
        output, _ = process.communicate(timeout=600)
        assert process.returncode == 0, output[-3000:]
        (run,) = new_run_dirs(cwd, set())
        shutil.copytree(recipe, run / rd.SNAPSHOT_DIRNAME)
        found.append(run)
    return found


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


IDS = torch.randint(0, 258, (2, 48), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def exported(runs, tmp_path_factory):
    folder = tmp_path_factory.mktemp("export") / "lm"
    result = model_io.export(runs[0], 4, folder, max_shard_size="100KB")
    return folder, result


def test_the_export_loads_with_from_pretrained_and_gives_the_same_logits(runs, exported):
    from transformers import AutoModelForCausalLM

    folder, result = exported
    assert result == ExportOutcome(step=4, lora=None, lora_layers=0, tokenizer="TokenizersBackend", parameters=119360)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all((folder / shard).is_file() for shard in shards)
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == 256

    loaded = AutoModelForCausalLM.from_pretrained(folder)
    original = model_io.load_engine(runs[0], 4).model
    delta = (logits(loaded, IDS) - logits(original, IDS)).abs().max().item()
    print(f"\n[export] template: max |Δlogits| = {delta} ({len(shards)} shards)")
    assert delta == 0.0


def test_the_byte_tokenizer_round_trips_through_auto_tokenizer(exported):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(exported[0])
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert ids == list(TEXT.encode()) and tokenizer.decode(ids) == TEXT
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id, len(tokenizer)) == (256, 257, 258)
    assert tokenizer.decode(ids + [256], skip_special_tokens=True) == TEXT


def test_generate_from_the_exported_folder_produces_text(exported):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(exported[0])
    model = AutoModelForCausalLM.from_pretrained(exported[0])
    prompt = tokenizer("the model ", return_tensors="pt")
    output = model.generate(**prompt, max_new_tokens=20, do_sample=False)
    text = tokenizer.decode(output[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True)
    print(f"[export] generate: {text!r}")
    assert output.shape[1] > prompt["input_ids"].shape[1] and text


def test_a_recipe_started_from_the_export_continues_with_the_loss_of_the_resumed_checkpoint(runs, exported):
    """The run resumed from step 4 and a run of the same recipe from the exported folder
    (``model.pretrained_path``), put at the same data position, compute the same loss on the
    first batch (before their first update; their optimizer states differ) and the same eval loss."""
    from engine.config import build_config
    from engine.launch import load_recipe_class

    run = runs[0]
    recipe_class = load_recipe_class(run / rd.SNAPSHOT_DIRNAME)
    record = rd.read_run(run)
    dist = DistInfo(0, 1, 0, torch.device("cpu"), None)
    resumed = recipe_class(build_config(recipe_class.config_class, None, {}, base=record.config), dist,
                           resume_from=run / rd.CHECKPOINTS_DIRNAME / run_checkpoints.checkpoint_dir_name(4))
    fresh = recipe_class(build_config(recipe_class.config_class, None, {"model.pretrained_path": str(exported[0])},
                                      base=record.config), dist)
    resumed.before_train()
    fresh.before_train()
    fresh.train_batches.load_state_dict(resumed.train_batches.state_dict())
    assert resumed.state.step == 4 and fresh.state.step == 0
    eval_resumed, eval_fresh = resumed.evaluate(), fresh.evaluate()
    loss_resumed, loss_fresh = float(resumed.train_step().loss), float(fresh.train_step().loss)
    print(f"[export] step 5 loss: resumed {loss_resumed!r}, from the export {loss_fresh!r}; "
          f"eval loss {eval_resumed!r} / {eval_fresh!r}")
    assert loss_fresh == loss_resumed and eval_fresh == eval_resumed
    # ... and model_io's evaluate reports the eval loss the run logged at step 4.
    logged = [r["eval_loss"] for r in run_metrics.read_all_metrics(run / rd.METRICS_JSONL) if r.get("step") == 4 and "eval_loss" in r]
    assert model_io.evaluate(run, 4).eval_loss == pytest.approx(logged[0], rel=1e-12) == eval_resumed


def test_a_lora_run_exports_merged_weights_or_a_peft_adapter(runs, tmp_path, monkeypatch):
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoModelForCausalLM

    from engine.hf_export import unload_lora

    run = runs[1]
    merged = model_io.export(run, 4, tmp_path / "merged")
    adapter = model_io.export(run, 4, tmp_path / "staging", lora="adapter", final_dir=tmp_path / "adapter")
    (tmp_path / "staging").rename(tmp_path / "adapter")
    assert (merged.lora, merged.lora_layers, adapter.lora) == ("merged", 14, "adapter")
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json", "base"} <= {
        p.name for p in (tmp_path / "adapter").iterdir()}

    with_adapters = model_io.load_engine(run, 4).model
    reference = logits(with_adapters, IDS)
    assert sum(p.abs().sum() for n, p in with_adapters.named_parameters() if "lora_B" in n) > 0  # it trained
    from_merged = logits(AutoModelForCausalLM.from_pretrained(tmp_path / "merged"), IDS)
    # The adapter names its base relative to the export, never by a path of this machine.
    adapter_config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == "base"
    monkeypatch.chdir(tmp_path / "adapter")
    from_adapter = logits(AutoPeftModelForCausalLM.from_pretrained(tmp_path / "adapter"), IDS)
    unload_lora(with_adapters, merge=True)
    merged_in_memory = logits(with_adapters, IDS)
    deltas = {
        "merged export vs the checkpoint's model merged": (from_merged - merged_in_memory).abs().max().item(),
        "adapter export vs the checkpoint's model": (from_adapter - reference).abs().max().item(),
        "merged export vs the checkpoint's model with adapters": (from_merged - reference).abs().max().item(),
    }
    print("[export] LoRA: " + "; ".join(f"{k}: max |Δlogits| = {v:.3g}" for k, v in deltas.items()))
    assert deltas["merged export vs the checkpoint's model merged"] == 0.0
    assert deltas["adapter export vs the checkpoint's model"] == 0.0
    assert deltas["merged export vs the checkpoint's model with adapters"] < 1e-4  # W + BA vs Wx + B(Ax): rounding


def test_sample_is_greedy_and_bounded_and_evaluate_needs_held_out_data(runs):
    first = model_io.sample(runs[0], 4, ["the model ", "loss"], max_new_tokens=12)
    again = model_io.sample(runs[0], 4, ["the model "], max_new_tokens=12)
    assert first.samples[0] == again.samples[0] and all(1 <= s.new_tokens <= 12 for s in first.samples)
    assert first.chat is False
    with pytest.raises(model_io.BadInput, match="at most 8 prompts"):
        model_io.sample(runs[0], 4, ["a"] * 9)
    with pytest.raises(model_io.NotFound, match="no complete checkpoint at step 3"):
        model_io.evaluate(runs[0], 3)


def test_sample_renders_prompts_as_user_turns_when_the_tokenizer_has_a_chat_template(runs, monkeypatch):
    import engine.launch

    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}<bot>{% endif %}"
    load = engine.launch.load_recipe_class

    def with_chat_template(folder):
        recipe_class = load(folder)
        plain = recipe_class.hf_processing

        def hf_processing(self):
            tokenizer = plain(self)
            tokenizer.chat_template = template
            return tokenizer

        recipe_class.hf_processing = hf_processing
        return recipe_class

    monkeypatch.setattr(engine.launch, "load_recipe_class", with_chat_template)
    chat = model_io.sample(runs[0], 4, ["hi"], max_new_tokens=8)
    monkeypatch.setattr(engine.launch, "load_recipe_class", load)
    plain = model_io.sample(runs[0], 4, ["<user>hi<bot>"], max_new_tokens=8)
    assert chat.chat is True and plain.chat is False
    assert chat.samples[0].completion == plain.samples[0].completion  # the same tokens in
