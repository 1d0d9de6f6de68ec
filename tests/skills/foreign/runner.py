"""Run training scripts in this one process (torch imported once), each as ``__main__`` through
``tests.skills.effect_probe``, and write what each did as JSON.

    python -m tests.skills.foreign.runner JOBS.json RESULTS.json

A job is ``{"name", "script", "argv", "cwd"}``; ``{"shim": "tiny_model" | "text_dataset", "folder"}``
entries make the offline inputs first. Per job: optimizer steps taken (a global step hook), the
losses the script printed (``loss <number>``), activation-checkpointed forwards (checkpoint_wrapper
or ``torch.utils.checkpoint``), compiled graphs (``torch.compile`` runs with the ``eager``
backend: tracing is what is checked, in seconds), forwards under autocast, and the error if any.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import traceback
from pathlib import Path

import torch
import torch.utils.checkpoint
from torch.optim.optimizer import register_optimizer_step_post_hook

from tests.skills.effect_probe import run_script
from tests.skills.foreign import shims

LOSS = re.compile(r"\bloss\b\W+(-?\d+(?:\.\d+)?(?:e-?\d+)?|nan|inf)", re.I)


def run_job(job: dict) -> dict:
    steps = 0
    checkpoint_calls = 0

    def count_step(optimizer, args, kwargs):
        nonlocal steps
        steps += 1

    original_generator = torch.utils.checkpoint._checkpoint_without_reentrant_generator
    original_apply = torch.utils.checkpoint.CheckpointFunction.apply

    def counting_generator(*args, **kwargs):
        nonlocal checkpoint_calls
        checkpoint_calls += 1
        return original_generator(*args, **kwargs)

    def counting_apply(*args, **kwargs):
        nonlocal checkpoint_calls
        checkpoint_calls += 1
        return original_apply(*args, **kwargs)

    original_compile = torch.compile

    def compile_eagerly(model=None, **kwargs):
        kwargs.pop("mode", None)
        kwargs["backend"] = "eager"
        return original_compile(model, **kwargs) if model is not None else original_compile(**kwargs)

    hook = register_optimizer_step_post_hook(count_step)
    torch.utils.checkpoint._checkpoint_without_reentrant_generator = counting_generator
    torch.utils.checkpoint.CheckpointFunction.apply = counting_apply
    torch.compile = compile_eagerly
    argv, cwd = sys.argv, os.getcwd()
    sys.argv = [job["script"], *job.get("argv", [])]
    os.chdir(job.get("cwd") or cwd)
    result = {"name": job["name"], "error": ""}
    try:
        effects = run_script(Path(job["script"]))
        printed = effects.printed
        result.update(
            checkpointed=effects.checkpointed, graphs=effects.graphs, autocast_forwards=effects.autocast_forwards,
            bfloat16_outputs=effects.bfloat16_outputs, lora_layers=effects.lora_layers,
        )
    except BaseException as e:  # SystemExit included: a script's failure is a result, not the runner's end
        printed = ""
        result["error"] = "".join(traceback.format_exception(e)[-6:])
    finally:
        _reset_singletons()
        hook.remove()
        torch.utils.checkpoint._checkpoint_without_reentrant_generator = original_generator
        torch.utils.checkpoint.CheckpointFunction.apply = original_apply
        torch.compile = original_compile
        sys.argv = argv
        os.chdir(cwd)
    losses = [float(m) for m in LOSS.findall(printed)]
    result.update(steps=steps, losses=losses, finite=bool(losses) and all(math.isfinite(x) for x in losses),
                  checkpoint_calls=checkpoint_calls, printed=printed[-2000:])
    return result


def _reset_singletons() -> None:
    """accelerate keeps one process-wide state (device, mixed precision): each script starts afresh,
    as it would in its own process."""
    state = sys.modules.get("accelerate.state")
    if state is not None:
        state.AcceleratorState._reset_state(reset_partial_state=True)
        state.GradientState._reset_state()


def main() -> None:
    jobs = json.loads(Path(sys.argv[1]).read_text())
    torch.set_num_threads(1)
    results = []
    for job in jobs:
        if "shim" in job:
            getattr(shims, job["shim"])(Path(job["folder"]))
            continue
        results.append(run_job(job))
        Path(sys.argv[2]).write_text(json.dumps(results, indent=1))  # what ran so far survives a timeout


if __name__ == "__main__":
    main()
