"""The grpo template: its loss and gradients are TRL's GRPOTrainer's for the same policy,
completions and rewards; its pieces (advantages, masks, reward checks) do what the config says;
runs log the reward metrics, refuse bad input at the launch check and resume bit for bit."""

from __future__ import annotations

import copy
import json
import shutil
import sys

import pytest
import torch

from engine import run_checkpoints
from engine import run_dir as rd
from engine import run_metrics
from engine.config import ConfigError
from recipes_template.grpo import recipe as grpo
from tests.support import REPO, losses, run_engine

TEMPLATE = REPO / "recipes_template" / "grpo"
SMALL = (
    "model.hidden_size=64", "model.intermediate_size=160", "model.num_layers=2", "data.seq_len=48",
    "data.batch_size=8", "data.builtin_prompts=200", "grpo.num_generations=4", "grpo.max_completion_length=6",
    "train.log_every=1", "optim.warmup_steps=2", "optim.lr=3e-3", "metrics.tensorboard=false",
    # A dense reward: a random model's groups differ from the first step (its exact answers are rare).
    "grpo.reward_functions=[digits_only,near_answer]", "grpo.reward_weights=null",
)


def policy_and_batch(temperature: float, seed: int = 0):
    """A tiny policy, two prompts of equal length with G=4 completions each (some ended by the
    end of turn, some cut off), rewards, old log-probabilities of a nearby policy and reference
    log-probabilities of another: every term of the loss is exercised."""
    torch.manual_seed(seed)
    tokenizer = grpo.byte_chat_tokenizer()
    model = grpo.build_model(grpo.ModelConfig(hidden_size=64, intermediate_size=160, num_layers=2), len(tokenizer), 64)
    records = [r for _, r in grpo.builtin_prompts(2, seed=1)]
    prompt_ids, prompt_mask = grpo.left_padded([grpo.prompt_tokens(tokenizer, r) for r in records], tokenizer.pad_token_id)
    assert bool(prompt_mask.all())  # equal lengths: TRL's positions (0, 1, ...) are the template's
    G, width = 4, 7
    prompt_ids, prompt_mask = prompt_ids.repeat_interleave(G, 0), prompt_mask.repeat_interleave(G, 0)
    completion_ids = torch.randint(0, 256, (2 * G, width))
    for row, end in enumerate([2, 6, None, 4, 0, None, 3, 5]):
        if end is not None:
            completion_ids[row, end] = tokenizer.eos_token_id
            completion_ids[row, end + 1:] = tokenizer.pad_token_id
    rewards = torch.tensor([1.0, 0.0, 0.5, 1.0, 0.0, 0.0, 1.0, 0.25])
    batch = {"input_ids": torch.cat([prompt_ids, completion_ids], 1)}
    return model, tokenizer, prompt_ids, prompt_mask, completion_ids, rewards, batch


@pytest.mark.parametrize("loss_type,scale,beta,iterations,epsilon_high,truncated,kl_ratio", [
    ("grpo", "group", 0.0, 1, None, False, True),
    ("dapo", "group", 0.0, 1, None, False, True),
    ("dr_grpo", "none", 0.0, 1, None, False, True),
    ("grpo", "group", 0.04, 2, 0.28, True, True),
    ("dapo", "none", 0.04, 2, 0.28, False, False),
    ("dr_grpo", "group", 0.1, 3, None, True, True),
])
def test_loss_and_gradients_equal_trls_grpo_trainer(loss_type, scale, beta, iterations, epsilon_high, truncated, kl_ratio,
                                                     tmp_path):
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    temperature = 0.7
    model, tokenizer, prompt_ids, prompt_mask, completion_ids, rewards, batch = policy_and_batch(temperature)
    section = grpo.GRPOSection(num_generations=4, max_completion_length=completion_ids.shape[1], temperature=temperature,
                               loss_type=loss_type, scale_rewards=scale, beta=beta, num_iterations=iterations,
                               epsilon_high=epsilon_high, mask_truncated_completions=truncated,
                               kl_ratio_correction=kl_ratio)
    mask, cut = grpo.completion_mask(completion_ids, tokenizer.eos_token_id, truncated)
    assert cut.tolist() == [False, False, True, False, False, True, False, False]
    advantages, _ = grpo.group_advantages(rewards, 4, scale == "group")
    batch |= {"attention_mask": torch.cat([prompt_mask, mask], 1), "completion_mask": mask, "advantages": advantages}
    nearby, reference = copy.deepcopy(model), copy.deepcopy(model)
    with torch.no_grad():  # the policy that generated (num_iterations > 1) and the reference differ from it
        for p, q in zip(nearby.parameters(), reference.parameters()):
            p.add_(0.05 * torch.randn_like(p))
            q.add_(0.05 * torch.randn_like(q))
        old = grpo.token_logps(nearby, batch, temperature)[0] if iterations > 1 else None
        ref = grpo.token_logps(reference, batch, temperature)[0] if beta else None

    model.save_pretrained(tmp_path / "policy")  # TRL loads it (and, with beta, its reference) from a folder
    args = trl.GRPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4,
        max_completion_length=completion_ids.shape[1], temperature=temperature, loss_type=loss_type,
        scale_rewards=scale, beta=beta, num_iterations=iterations, epsilon_high=epsilon_high,
        mask_truncated_completions=truncated, use_bias_correction_kl=kl_ratio, report_to=[], use_cpu=True, bf16=False,  # float32, as ours
        model_init_kwargs={"dtype": torch.float32, "attn_implementation": "sdpa"},
    )
    trainer = trl.GRPOTrainer(
        model=str(tmp_path / "policy"), reward_funcs=[lambda completions, **_: [0.0] * len(completions)], args=args,
        train_dataset=datasets.Dataset.from_list([{"prompt": "What is 1 + 1?"}] * 8), processing_class=tokenizer,
    )
    theirs_model = trainer.model
    trainer.current_gradient_accumulation_steps = 1
    inputs = {
        "prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids, "completion_mask": mask,
        "advantages": advantages, "num_items_in_batch": mask.sum(),
    }
    if old is not None:
        inputs["old_per_token_logps"] = old
    if ref is not None:
        inputs["ref_per_token_logps"] = ref
    theirs_model.train()
    their_loss = trainer._compute_loss(theirs_model, inputs)
    their_loss.backward()

    model.train()
    logps, _ = grpo.token_logps(model, batch, temperature)
    loss, _, _ = grpo.grpo_loss(logps, logps.detach() if old is None else old, ref, advantages, mask, section)
    loss = loss / grpo.loss_units(mask, section)
    loss.backward()

    assert abs(float(loss) - float(their_loss)) < 1e-5, (float(loss), float(their_loss))
    assert float(loss) != 0.0
    for (name, ours), theirs in zip(model.named_parameters(), theirs_model.parameters()):
        assert ours.grad is not None and theirs.grad is not None, name
        assert torch.allclose(ours.grad, theirs.grad, atol=1e-5, rtol=0), (name, float((ours.grad - theirs.grad).abs().max()))


def test_advantages_are_relative_to_the_group_and_scaled_by_its_std_or_not():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    scaled, std = grpo.group_advantages(rewards, 4, scale=True)
    assert torch.allclose(scaled[:4], torch.tensor([0.5, -0.5, -0.5, 0.5]) / (0.57735027 + 1e-4))
    assert scaled[4:].tolist() == [0.0] * 4 and std[4:].tolist() == [0.0] * 4  # a group without signal
    plain, _ = grpo.group_advantages(rewards, 4, scale=False)
    assert plain.tolist() == [0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 0.0, 0.0]


def test_the_completion_mask_ends_at_the_end_of_turn_and_may_drop_truncated_completions():
    ids = torch.tensor([[5, 256, 257, 257], [5, 6, 7, 8], [256, 257, 257, 257]])
    mask, truncated = grpo.completion_mask(ids, 256, mask_truncated=False)
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]] and truncated.tolist() == [False, True, False]
    mask, _ = grpo.completion_mask(ids, 256, mask_truncated=True)
    assert mask.tolist() == [[1, 1, 0, 0], [0, 0, 0, 0], [1, 0, 0, 0]]


def groups_of_left_padded_prompts(seed: int = 0):
    """A tiny policy; three prompts of different lengths (left-padded), G=3 completions of 5
    tokens each, some ended by the end of turn and padded."""
    torch.manual_seed(seed)
    tokenizer = grpo.byte_chat_tokenizer()
    model = grpo.build_model(grpo.ModelConfig(hidden_size=64, intermediate_size=160, num_layers=2), len(tokenizer), 64)
    texts = ["What is 1 + 1?", "Add 12 and 30, then tell me the sum.", "7 + 8?"]
    prompt_ids, prompt_mask = grpo.left_padded([grpo.prompt_tokens(tokenizer, {"prompt": t}) for t in texts],
                                               tokenizer.pad_token_id)
    assert not bool(prompt_mask.all())
    completion_ids = torch.randint(0, 256, (9, 5))
    completion_ids[1, 2:] = torch.tensor([tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.pad_token_id])
    mask, _ = grpo.completion_mask(completion_ids, tokenizer.eos_token_id, False)
    input_ids = torch.cat([prompt_ids.repeat_interleave(3, 0), completion_ids], 1)
    attention_mask = torch.cat([prompt_mask.repeat_interleave(3, 0), mask], 1)
    return model, tokenizer, prompt_ids, prompt_mask, input_ids, attention_mask


def whole_row_logits(model, input_ids, attention_mask, width):
    positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions).logits[:, -width - 1:-1]


def rows_read(model) -> list[int]:
    """The rows of each forward of ``model`` from now on."""
    seen: list[int] = []
    model.get_input_embeddings().register_forward_hook(lambda module, args, out: seen.append(args[0].shape[0]))
    return seen


@pytest.mark.parametrize("checkpointed", [False, True])
def test_a_groups_prompt_is_read_once_for_the_logits_and_gradients_of_reading_each_row_whole(checkpointed):
    model, _, _, _, input_ids, attention_mask = groups_of_left_padded_prompts()
    theirs = copy.deepcopy(model)
    assert not grpo.reads_rows_whole(model)
    if checkpointed:  # blocks that run their forward again in backward would replay the cache: each row whole
        sys.path.insert(0, str(REPO / "skills" / "gradient-checkpointing"))
        from helpers import checkpoint_blocks

        assert checkpoint_blocks(model) == 2 and grpo.reads_rows_whole(model)
    model.train(), theirs.train()
    seen = rows_read(model)
    ours = grpo.completion_logits(model, input_ids, attention_mask, 5)
    expected = whole_row_logits(theirs, input_ids, attention_mask, 5)
    assert seen == ([9] if checkpointed else [3, 9])  # the prompts' pass reads one row per group
    assert ours.shape == expected.shape == (9, 5, model.config.vocab_size)
    assert torch.allclose(ours, expected, atol=1e-5, rtol=0), float((ours - expected).abs().max())
    weights = torch.randn_like(expected)
    (ours * weights).sum().backward()
    (expected * weights).sum().backward()
    for (name, p), q in zip(model.named_parameters(), theirs.parameters()):  # float32 sums in another order
        error = float((p.grad - q.grad).abs().max() / q.grad.abs().max())
        assert 0 < q.grad.abs().max() and error < 1e-5, (name, error)


def test_compiled_blocks_read_each_row_whole():
    model, *_ = groups_of_left_padded_prompts()
    model.model.layers[1].compile()  # as the torch-compile skill does; nothing compiles before a call
    assert grpo.reads_rows_whole(model)


def test_generation_reads_each_prompt_once_for_its_group_and_samples_as_from_repeated_rows():
    model, tokenizer, prompt_ids, prompt_mask, _, _ = groups_of_left_padded_prompts()
    model.eval()
    seen = rows_read(model)
    grouped = grpo.generate(model, tokenizer, prompt_ids, prompt_mask, 6, 1.0, 1.0, torch.Generator().manual_seed(3),
                            repeats=4)
    assert seen[0] == 3 and set(seen[1:]) == {12} and grouped.shape[0] == 12
    repeated = grpo.generate(model, tokenizer, prompt_ids.repeat_interleave(4, 0), prompt_mask.repeat_interleave(4, 0), 6,
                             1.0, 1.0, torch.Generator().manual_seed(3))
    assert grouped.tolist() == repeated.tolist()
    assert len({tuple(row) for row in grouped.tolist()}) > 3  # a group's completions are sampled apart


def test_the_shipped_rewards_score_the_answer_and_its_format():
    completions = ["7", "It is 7.", "8", "seven"]
    assert grpo.correct_answer(None, completions, ["7"] * 4) == [1.0, 1.0, 0.0, 0.0]
    assert grpo.digits_only(None, completions) == [1.0, 0.125, 1.0, 0.0]
    assert grpo.near_answer(None, completions, ["7"] * 4) == [1.0, 1.0, 0.8, 0.0]
    chat = [[{"role": "assistant", "content": "7"}]]
    assert grpo.correct_answer(None, chat, ["7"]) == [1.0]


def test_a_reward_function_that_fails_stops_the_run_naming_itself_and_the_prompt(monkeypatch):
    prompts, completions = ["What is 1 + 1?", "What is 2 + 2?"], ["2", "5"]
    monkeypatch.setattr(grpo, "raises", lambda prompts, completions, **_: 1 / 0, raising=False)
    monkeypatch.setattr(grpo, "too_few", lambda prompts, completions, **_: [1.0], raising=False)
    monkeypatch.setattr(grpo, "not_finite", lambda prompts, completions, **_: [1.0, float("nan")], raising=False)
    with pytest.raises(ConfigError, match=r"reward function raises raised ZeroDivisionError: division by zero "
                                          r"\(prompts from 'What is 1 \+ 1\?'\)"):
        grpo.score(["raises"], prompts, completions, {}, [[1], [2]])
    with pytest.raises(ConfigError, match=r"reward function too_few returned 1 values for 2 completions"):
        grpo.score(["too_few"], prompts, completions, {}, [[1], [2]])
    with pytest.raises(ConfigError, match=r"reward function not_finite returned nan for the prompt 'What is 2 \+ 2\?'"):
        grpo.score(["not_finite"], prompts, completions, {}, [[1], [2]])
    table = grpo.score(["correct_answer", "digits_only"], prompts, completions, {"answer": ["2", "4"]}, [[1], [2]])
    assert table.tolist() == [[1.0, 1.0], [0.0, 1.0]]


@pytest.fixture
def check(tmp_path, capsys, monkeypatch):
    """The launch check's verdict or refusal (its one JSON line) for the template with some
    overrides, run in ``tmp_path`` by ``engine.launch.main`` in this process: the check's code
    without a fresh interpreter's imports (~10 s a check on 2 cores)."""
    from engine.launch import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the recipe folder each check puts first, dropped after

    def verdict(*overrides: str) -> dict:
        main([str(TEMPLATE), "--check", *[f"--set={item}" for item in overrides]])
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    return verdict


def test_prompts_carry_tools_and_earlier_tool_rounds_into_the_models_template(tmp_path):
    # Qwen2.5's template: a tools column becomes its "# Tools" system block; a prompt that already
    # holds a call and its result renders them (the sft template's reading of messages).
    from tests.model_families import FAMILIES, bpe_tokenizer

    tokenizer = bpe_tokenizer(FAMILIES["qwen2.5"][3], FAMILIES["qwen2.5"][4], FAMILIES["qwen2.5"][2])
    tools = [{"type": "function", "function": {"name": "add", "description": "Add two integers.",
                                               "parameters": {"type": "object", "properties": {}}}}]
    call = {"type": "function", "function": {"name": "add", "arguments": '{"a": 12, "b": 1}'}}
    prompt = [{"role": "user", "content": "What is 12 + 1?"},
              {"role": "assistant", "content": None, "tool_calls": [call]}, {"role": "tool", "content": "13"}]
    rendered = tokenizer.decode(grpo.prompt_tokens(tokenizer, {"prompt": prompt, "tools": json.dumps(tools)}))
    assert "# Tools" in rendered and '"name": "add"' in rendered and "<tool_response>\n13\n</tool_response>" in rendered
    assert rendered.endswith("<|im_start|>assistant\n")
    plain = tokenizer.decode(grpo.prompt_tokens(tokenizer, {"prompt": "What is 12 + 1?"}))
    assert "# Tools" not in plain and plain.endswith("<|im_start|>assistant\n")
    with pytest.raises(ConfigError, match=r"prompts.jsonl:3: tools\[1\] is not a function schema"):
        grpo.prompt_tokens(tokenizer, {"prompt": "x", "tools": [{"name": 3}]}, "prompts.jsonl:3")
    with pytest.raises(ConfigError, match=r"prompts.jsonl:4: prompt\[2\].*'tool_calls' must be a list"):
        grpo.prompt_tokens(tokenizer, {"prompt": [prompt[0], {"role": "assistant", "tool_calls": "add"}]}, "prompts.jsonl:4")


def test_bad_input_is_refused_at_the_launch_check_with_what_to_change(tmp_path, check):
    (tmp_path / "questions.jsonl").write_text(json.dumps({"question": "What is 1 + 1?", "answer": "2"}) + "\n")
    refusals = {
        "no prompt column": check("data.paths=[questions.jsonl]"),
        "undefined reward": check("grpo.reward_functions=[correct_answer,is_polite]", "grpo.reward_weights=null"),
        "one completion": check("grpo.num_generations=1", "data.batch_size=4"),
        "too long": check("grpo.max_completion_length=96"),
        "vllm": check("grpo.generation_engine=vllm"),
    }
    assert "questions.jsonl:1: no prompt column 'prompt' (columns: ['answer', 'question']); name the prompt's column " \
           "with data.prompt_column" in refusals["no prompt column"]["error"]
    assert "grpo.reward_functions names 'is_polite', which recipe.py does not define; define def is_polite(prompts, " \
           "completions, **columns) -> list[float] there, or name one of ['correct_answer', 'digits_only', " \
           "'near_answer']" \
           in refusals["undefined reward"]["error"]
    assert "grpo.num_generations=1: a group needs at least 2 completions" in refusals["one completion"]["error"]
    assert "grpo.max_completion_length=96 leaves no room for a prompt in data.seq_len=96" in refusals["too long"]["error"]
    assert refusals["vllm"]["error"].endswith(grpo.vllm_refusal())  # what this machine lacks: the test below
    assert sorted(p.name for p in tmp_path.iterdir()) == ["questions.jsonl"]  # nothing written
    renamed = check("data.paths=[questions.jsonl]", "data.prompt_column=question", "data.eval_fraction=0")
    assert renamed["data"]["documents"] == 1 and renamed["data"]["train_documents"] == 1


def test_estimate_run_measures_a_grpo_step_on_the_meta_device(tmp_path, capsys, monkeypatch):
    """The loss's forward groups rows by their prompts' values; the estimate's fake tensors have
    none, so it measures rows read whole (the most the step can hold)."""
    from engine.launch import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    main([str(TEMPLATE), "--check", "--estimate", "cpu", "--set=model.num_layers=2", "--set=data.batch_size=8"])
    verdict = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert verdict["ok"], verdict.get("error")
    assert verdict["estimate"]["memory_gib"]["activations"] > 0 and verdict["estimate"]["checkpointed_blocks"] == "0 of 2"


def test_vllm_generation_is_refused_naming_what_is_missing(monkeypatch):
    import importlib.util

    def machine(vllm: bool, cuda: bool) -> str:
        monkeypatch.setattr(importlib.util, "find_spec", lambda name: object() if vllm and name == "vllm" else None)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
        return grpo.vllm_refusal()

    default = "set grpo.generation_engine=transformers (the default: the policy's own generation with a KV cache)"
    assert machine(vllm=False, cuda=False) == ("grpo.generation_engine=vllm needs vLLM on a CUDA GPU, but vllm is not "
                                               f"installed in the run's environment and no CUDA GPU is visible; {default}")
    assert machine(vllm=False, cuda=True) == ("grpo.generation_engine=vllm needs vLLM on a CUDA GPU, but vllm is not "
                                              f"installed in the run's environment; {default}")
    assert machine(vllm=True, cuda=False) == f"grpo.generation_engine=vllm needs vLLM on a CUDA GPU, but no CUDA GPU is visible; {default}"
    assert machine(vllm=True, cuda=True) == ("grpo.generation_engine=vllm is not wired in this template yet; set "
                                             "grpo.generation_engine=transformers")


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("grpo")
    recipe = root / "grpo"
    shutil.copytree(TEMPLATE, recipe, ignore=shutil.ignore_patterns("__pycache__"))
    return root, recipe


SCHEDULE = (*SMALL, "grpo.num_iterations=2", "grpo.beta=0.05", "train.max_steps=6", "checkpoint.every=3",
            "checkpoint.keep_last=5")


@pytest.fixture(scope="module")
def reference(workspace):
    root, recipe = workspace
    return run_engine(root, recipe, *SCHEDULE)


def test_a_run_logs_rewards_lengths_and_where_the_time_goes(reference):
    record = rd.read_run(reference)
    assert record.status == rd.COMPLETED and record.data.documents == 200
    logged = [r for r in run_metrics.read_all_metrics(reference / rd.METRICS_JSONL) if "kl" in r]
    assert [r["step"] for r in logged] == list(range(1, 7))
    optimisation = {"kl", "clip_frac", "entropy", "training_s", "training_tokens_per_s"}
    rollout = {"reward", "reward_std", "reward_digits_only", "reward_digits_only_std", "reward_near_answer",
               "reward_near_answer_std", "group_reward_std",
               "zero_signal_groups", "completion_length", "completion_length_max", "truncated_frac", "generation_s", "reward_s", "generation_tokens_per_s",
               "reward_tokens_per_s"}
    # A generation every second step (num_iterations=2): the steps between report no rollout.
    assert [set(r) - {"step", "elapsed_s"} for r in logged] == [optimisation | rollout, optimisation] * 3
    assert logged[0]["kl"] == 0 and logged[0]["clip_frac"] == 0  # the policy is its reference and its old self
    assert any(r["kl"] > 0 for r in logged[1:])  # once a group had a signal, the policy moved from its reference
    assert all(0 <= r["clip_frac"] <= 1 for r in logged)
    for r in logged[::2]:
        assert r["generation_s"] > 0 and r["reward_s"] > 0 and r["training_s"] > 0
        assert 1 <= r["completion_length"] <= r["completion_length_max"] <= 6 and 0 <= r["truncated_frac"] <= 1
        weighted = r["reward_digits_only"] + r["reward_near_answer"]
        assert r["reward"] == pytest.approx(weighted, abs=1e-6)


def test_resume_is_bit_identical_from_the_middle_of_a_generation(workspace, reference):
    root, recipe = workspace
    (_, checkpoint), *_ = run_checkpoints.list_checkpoints(reference)  # step 3: one pass of a generation to go
    resumed = run_engine(root, recipe, *SCHEDULE, resume_from=checkpoint)
    assert losses(resumed) == {s: v for s, v in losses(reference).items() if s > 3}
    rewards = {r["step"]: r["reward"] for r in run_metrics.read_all_metrics(resumed / rd.METRICS_JSONL) if "reward" in r}
    assert rewards == {r["step"]: r["reward"] for r in run_metrics.read_all_metrics(reference / rd.METRICS_JSONL)
                       if "reward" in r and r["step"] > 3}


def test_sample_evaluate_and_export_work_on_a_grpo_run(workspace, reference):
    from engine import model_io

    root, recipe = workspace
    if not (reference / rd.SNAPSHOT_DIRNAME).is_dir():  # the code snapshot the server gives a run
        shutil.copytree(recipe, reference / rd.SNAPSHOT_DIRNAME)
    evaluated = model_io.evaluate(reference, 6)
    assert set(evaluated.metrics) == {"reward", "reward_digits_only", "reward_near_answer", "prompts"}
    assert evaluated.metrics["prompts"] == rd.read_run(reference).data.eval_documents > 0
    assert evaluated.eval_loss == pytest.approx(-evaluated.metrics["reward"], abs=1e-6)
    sampled = model_io.sample(reference, 6, ["What is 1 + 2?"], max_new_tokens=4).samples
    assert len(sampled) == 1 and isinstance(sampled[0].completion, str)
    exported = model_io.export(reference, 6, root / "exported")
    from transformers import AutoModelForCausalLM

    assert exported.step == 6
    assert AutoModelForCausalLM.from_pretrained(root / "exported").config.hidden_size == 64


@pytest.mark.multiprocess
@pytest.mark.slow  # three two-process runs
def test_two_processes_sample_apart_under_fsdp2_and_resume_bit_for_bit(workspace):
    root, recipe = workspace
    two = run_engine(root, recipe, *SCHEDULE, nproc=2)
    logged = [r for r in run_metrics.read_all_metrics(two / rd.METRICS_JSONL) if "kl" in r]
    assert [r["step"] for r in logged] == list(range(1, 7)) and any(r["kl"] > 0 for r in logged)
    (_, checkpoint), *_ = run_checkpoints.list_checkpoints(two)  # step 3: mid-generation
    resumed = run_engine(root, recipe, *SCHEDULE, resume_from=checkpoint, nproc=2)
    assert losses(resumed) == {s: v for s, v in losses(two).items() if s > 3}
    # Each rank has a sampling generator of its own: the same prompt on both ranks gets other completions.
    from engine.config import build_config
    from engine.distributed import DistInfo

    engine = grpo.GRPO(build_config(grpo.GRPOConfig, None, list(SMALL)), DistInfo(0, 1, 0, torch.device("cpu"), None))
    engine.model = engine.prepare_model()
    engine.prepare_data()  # rank 0's stream; below, one per rank
    completions = []
    for rank in (0, 1):
        stream = grpo.RolloutStream(engine.prompts[0], 0, 1, 1, 1, rank, 2, engine.make_rollout, torch.device("cpu"))
        completions.append(stream.make_rollout([engine.prompts[0][0]], stream.sampling_rng)["input_ids"])
    assert not torch.equal(completions[0], completions[1])


def test_skills_apply_to_the_policy_after_the_reference_is_built(tmp_path):
    from skills import apply_skill

    recipe = tmp_path / "grpo"
    shutil.copytree(TEMPLATE, recipe, ignore=shutil.ignore_patterns("__pycache__"))
    for skill in ("lora", "gradient-checkpointing", "torch-compile", "mixed-precision"):
        assert apply_skill(skill, recipe).changed, skill
    source = (recipe / "recipe.py").read_text()
    assert source.index("self.reference = reference") < source.index("apply_lora(model")
