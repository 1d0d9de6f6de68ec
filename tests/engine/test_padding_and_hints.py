"""padding_frac counts padding only; a run suggests the skill that fits what it measured, once;
the console shows a recipe's own values (DPO's rewards) and prints no empty step lines."""

from __future__ import annotations

import io
from types import SimpleNamespace

import torch

from engine import run_metrics
from engine.engine import IGNORE_INDEX, Engine
from engine.metrics.console import ConsoleBackend


def engine_with(tokenizer=None, processor=None) -> Engine:
    engine = Engine.__new__(Engine)  # the counting hooks need no config
    if tokenizer is not None:
        engine.__dict__["tokenizer"] = tokenizer
    if processor is not None:
        engine.__dict__["processor"] = processor
    return engine


def test_masked_prompt_tokens_are_not_padding():
    pad = 0
    ids = torch.tensor([[5, 6, 7, 8, pad, pad], [5, 6, 7, 8, 9, 10]])
    labels = torch.tensor([[IGNORE_INDEX, IGNORE_INDEX, 7, 8, IGNORE_INDEX, IGNORE_INDEX],  # prompt, answer, padding
                           [IGNORE_INDEX, 6, 7, 8, 9, 10]])
    batch = {"input_ids": ids, "labels": labels, "attention_mask": (ids != pad).long()}
    assert engine_with(SimpleNamespace(pad_token_id=pad)).count_padding(batch) == 2
    assert engine_with(processor=SimpleNamespace(tokenizer=SimpleNamespace(pad_token_id=pad))).count_padding(batch) == 2
    # A pad id that is also learnt (an end of text that pads) counts only where it is not learnt.
    labels[1, 5] = pad
    ids[1, 5] = pad
    assert engine_with(SimpleNamespace(pad_token_id=pad)).count_padding(batch) == 2
    # Without a tokenizer: the attention mask's zeros.
    assert engine_with().count_padding(batch) == 2
    assert engine_with().count_padding({"input_ids": ids, "labels": labels}) == 0


def test_a_run_suggests_packing_above_30_percent_padding_and_checkpointing_near_its_memory_limit_once():
    said: list[str] = []
    fake = SimpleNamespace(device=torch.device("cpu"), warn=said.append)
    fake.packing_hint = lambda: Engine.packing_hint(fake)
    record = run_metrics.MetricRecord(step=5, loss=1.0, padding_frac=0.45, peak_mem_mb=10.0)
    Engine.suggest_skills(fake, record)
    assert said == ["45% of the positions of step 5 were padding: the sequence-packing skill fills each row with "
                    "whole examples (apply_skill sequence-packing)"]
    said.clear()
    Engine.suggest_skills(fake, run_metrics.MetricRecord(step=6, loss=1.0, padding_frac=0.2, peak_mem_mb=10.0))
    Engine.suggest_skills(fake, run_metrics.MetricRecord(step=7, loss=1.0, padding_frac=0.6, peak_mem_mb=10.0))  # said already
    assert said == []
    import engine.engine as engine_module

    limit = engine_module._memory_limit_mb(torch.device("cpu"))
    assert limit and limit > 0
    Engine.suggest_skills(fake, run_metrics.MetricRecord(step=8, loss=1.0, padding_frac=0.0, peak_mem_mb=0.9 * limit))
    Engine.suggest_skills(fake, run_metrics.MetricRecord(step=9, loss=1.0, padding_frac=0.0, peak_mem_mb=0.95 * limit))
    assert len(said) == 1 and said[0].startswith("peak memory") and "gradient-checkpointing" in said[0]


def test_the_engine_warns_once_per_message():
    engine = Engine.__new__(Engine)
    engine._warned = set()
    engine.dist = SimpleNamespace(is_main=True)
    engine.run_dir = None
    printed = io.StringIO()
    import contextlib

    with contextlib.redirect_stdout(printed):
        for _ in range(3):
            engine.warn("a hint")
    assert printed.getvalue() == "warning: a hint\n"


def test_the_console_shows_a_recipes_own_values_and_skips_a_bare_step():
    out = io.StringIO()
    console = ConsoleBackend(30, out)
    console.log({"step": 5})
    console.log({"step": 5, "reward_accuracy": 0.75, "reward_margin": 0.125, "chosen_reward": -1.5})
    console.log({"step": 5, "loss": 0.5, "tokens_seen": 100, "data_s": 0.1})
    assert out.getvalue().splitlines() == [
        "step  5/30 | reward_accuracy 0.75 | reward_margin 0.125 | chosen_reward -1.5",
        "step  5/30 | loss 0.5000",
    ]
