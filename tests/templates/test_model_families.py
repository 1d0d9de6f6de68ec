"""Any causal LM transformers knows: tiny random-weight Qwen2, Llama, Gemma 2, Mistral and Phi-3
models (tokenizers trained here, each family's chat format without markers) are fine-tuned by
the sft template as they are — the loss on each family's assistant turns, FSDP2 on the model's
own decoder layers, LoRA on its projection names, gradient checkpointing on its layers — and
exported as the model's own class with its tokenizer and chat template."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch

from engine import run_dir as rd
from engine.engine import IGNORE_INDEX
from engine.fsdp import transformer_blocks
from recipes_template.sft import recipe as sft
from skills import apply_skill
from tests.model_families import FAMILIES, tiny_model_folder
from tests.support import REPO, losses, run_engine

# What each family's template adds after an answer: the end of turn it learns.
END_OF_TURN = {"qwen2": "<|im_end|>\n", "llama": "<|eot_id|>", "gemma2": "<end_of_turn>\n",
               "mistral": "<|im_end|>\n", "phi3": "<|im_end|>\n", "qwen3": "<|im_end|>\n", "qwen2.5": "<|im_end|>\n",
               "llama3.1": "<|eot_id|>"}
# Qwen3's template writes an empty <think> block into the last answer (and so rewrites the earlier one).
LAST_ANSWER_OPENS = {"qwen3": "<think>\n\n</think>\n\n"}
# gpt-oss ends an earlier answer with <|end|> and the last with <|return|>: the whole rendering.
HARMONY = {"gpt-oss": "<|channel|>final<|message|>It is 7.<|end|><|channel|>final<|message|>4<|return|>"}
PROJECTIONS = {"qwen2": {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"},
               "phi3": {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"},
               # gpt-oss's experts are parameters of one module, not Linear layers: its attention.
               "gpt-oss": {"q_proj", "k_proj", "v_proj", "o_proj"}}
CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 3 + 4?"},
                {"role": "assistant", "content": "It is 7."}, {"role": "user", "content": "And 2 + 2?"},
                {"role": "assistant", "content": "4"}]


def load_module(path: Path):
    from engine.launch import load_recipe_class

    return sys.modules[load_recipe_class(path).__module__]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {family: tiny_model_folder(root / family, family) for family in FAMILIES}


@pytest.fixture(scope="module")
def skilled(tmp_path_factory):
    """The sft template with the lora and gradient-checkpointing skills applied."""
    recipe = tmp_path_factory.mktemp("skilled") / "sft"
    shutil.copytree(REPO / "recipes_template" / "sft", recipe, ignore=shutil.ignore_patterns("__pycache__"))
    apply_skill("lora", recipe)
    apply_skill("gradient-checkpointing", recipe)
    return recipe


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_family_learns_its_assistant_turns_and_its_end_of_turn(family, folders):
    tokenizer = sft.load_tokenizer(str(folders[family]), None)
    expected_mask = "final_render" if family in LAST_ANSWER_OPENS or family in HARMONY else "turn_render"
    assert sft.mask_method(tokenizer, {"messages": CONVERSATION}) == expected_mask
    piece, why, _ = sft.encode_example(tokenizer, CONVERSATION, 512)  # gpt-oss writes a long system message
    assert why is None
    learnt = tokenizer.decode([t for t in piece[1].tolist() if t != IGNORE_INDEX])
    end = END_OF_TURN.get(family, "")
    assert learnt == HARMONY.get(family, f"It is 7.{end}{LAST_ANSWER_OPENS.get(family, '')}4{end}")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_fsdp_lora_and_checkpointing_act_on_the_familys_own_layers(family, folders, skilled):
    module = load_module(skilled)
    model = sft.build_model(sft.ModelConfig(pretrained_path=str(folders[family])), 0, 64)
    layer_class = f"{FAMILIES[family][1].removesuffix('ForCausalLM')}DecoderLayer"
    assert layer_class in model._no_split_modules
    assert [type(b).__name__ for b in transformer_blocks(model)] == [layer_class] * 2
    module.apply_lora(model)
    adapted = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if hasattr(m, "lora_A")}
    assert adapted == PROJECTIONS.get(family, PROJECTIONS["qwen2"])
    # The skill turns on the family's own switch (the statement it wrote into prepare_model).
    switch = 'model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})'
    assert switch in (skilled / "recipe.py").read_text()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    layers = [m for m in model.modules() if type(m).__name__ == layer_class]
    assert len(layers) == 2 and all(m.gradient_checkpointing for m in layers)
    # The layers stay the family's own classes: FSDP2 shards them by _no_split_modules.
    assert transformer_blocks(model) == layers


def write_data(root: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"messages": [{"role": "user", "content": f"What is {a} + {b}?"},
                          {"role": "assistant", "content": f"It is {a + b}."}]} for a in range(8) for b in range(4)]
    (root / "data").mkdir(exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), root / "data" / "train.parquet")


SCHEDULE = ("data.paths=[data/train.parquet]", "data.seq_len=48", "data.batch_size=4", "train.max_steps=3",
            "train.log_every=1", "checkpoint.every=3", "metrics.tensorboard=false", "data.eval_fraction=0")


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gemma2", "llama", "phi3", "gpt-oss"])
def test_a_family_trains_with_lora_and_checkpointing_and_exports_as_its_own_class(family, folders, skilled, tmp_path,
                                                                                 monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine import model_io

    write_data(tmp_path)
    shutil.copytree(folders[family], tmp_path / "model")
    longer = ["data.seq_len=256"] if family in HARMONY else []  # gpt-oss's system message is long
    run = run_engine(tmp_path, skilled, *SCHEDULE, "model.pretrained_path=model", *longer)
    record = rd.read_run(run)
    assert record.status == rd.COMPLETED and (record.data.format, record.data.mask) == ("messages", "turn_render")
    assert len(losses(run)) == 3
    out = tmp_path / "export"
    shutil.copytree(skilled, run / "recipe")  # the snapshot a supervised run keeps
    monkeypatch.chdir(tmp_path)  # model.pretrained_path=model, as the run read it
    monkeypatch.setattr(sys, "path", list(sys.path))  # the snapshot folder the export puts first, dropped after
    assert model_io.export(run, 3, out).step == 3  # in this process: a fresh interpreter is ~10 s on 2 cores
    model = AutoModelForCausalLM.from_pretrained(out)
    assert type(model).__name__ == FAMILIES[family][1]
    assert AutoTokenizer.from_pretrained(out).chat_template == FAMILIES[family][2]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_processes_match_one_on_a_llama_folder(folders, tmp_path):
    write_data(tmp_path)
    shutil.copytree(folders["llama"], tmp_path / "model")
    recipe = tmp_path / "sft"
    shutil.copytree(REPO / "recipes_template" / "sft", recipe, ignore=shutil.ignore_patterns("__pycache__"))
    settings = (*SCHEDULE, "model.pretrained_path=model", "checkpoint.every=0", "checkpoint.at_end=false")
    one = losses(run_engine(tmp_path, recipe, *settings))
    two = losses(run_engine(tmp_path, recipe, *settings, nproc=2))
    assert sorted(one) == sorted(two) == [1, 2, 3]
    for step in one:
        assert abs(one[step] - two[step]) <= 1e-5 * abs(one[step]), (step, one[step], two[step])
    assert torch.isfinite(torch.tensor(list(one.values()))).all()
