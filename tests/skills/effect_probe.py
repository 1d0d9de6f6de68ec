"""Run a (skill-applied) training script in this process and record what the skill changed.

``run_script(path)`` executes the script as ``__main__`` (``runpy``) with global module hooks
installed, then reads the trained models back from the script's globals:

- ``checkpointed``: ``CheckpointWrapper`` modules, and Hugging Face layers whose own
  ``gradient_checkpointing`` switch is on, whose forward ran in training;
- ``compiled``: modules on which ``Module.compile`` was called and whose compiled forward ran
  (dynamo captured at least one graph); the probe compiles with the ``eager`` backend, so what
  is proven is that torch.compile traces the modules, in seconds instead of inductor's minutes;
- ``autocast_forwards`` / ``bfloat16_outputs``: module forwards run under CPU autocast, and
  ``nn.Linear``/``nn.Conv*`` outputs in bfloat16;
- ``lora_layers``, ``trainable``, ``frozen``: adapted layers and parameter counts of the models;
  ``frozen_changed``: frozen parameters that differ from their value at the first forward
  (must be empty); ``trainable_changed``: trainable parameters that moved;
- ``forwards``: forward calls per module class (a checkpointed block's submodules run twice
  per step: once forward, once when backward recomputes them);
- ``printed``: the script's console lines (the helpers' counts).
"""

from __future__ import annotations

import collections
import contextlib
import io
import os
import runpy
from dataclasses import dataclass, field
from pathlib import Path

import torch


@dataclass
class Effects:
    checkpointed: int = 0
    compiled: int = 0
    graphs: int = 0
    autocast_forwards: int = 0
    bfloat16_outputs: int = 0
    lora_layers: int = 0
    trainable: int = 0
    frozen: int = 0
    frozen_changed: list[str] = field(default_factory=list)
    trainable_changed: int = 0
    forwards: collections.Counter = field(default_factory=collections.Counter)
    printed: str = ""
    globals: dict = field(default_factory=dict)


def run_script(path: Path) -> Effects:
    from torch._dynamo.utils import counters
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    from transformers.modeling_layers import GradientCheckpointingLayer

    effects = Effects()
    first_seen: dict[int, dict[str, torch.Tensor]] = {}  # module id → its own parameters at first forward
    modules: dict[int, torch.nn.Module] = {}
    compiled: list[torch.nn.Module] = []
    ran_checkpointed: set[int] = set()

    def before(module, args):
        if torch.compiler.is_compiling():
            return
        if id(module) not in modules:
            modules[id(module)] = module
            first_seen[id(module)] = {n: p.detach().clone() for n, p in module.named_parameters(recurse=False)}
        if isinstance(module, CheckpointWrapper) or (
            isinstance(module, GradientCheckpointingLayer) and module.training and module.gradient_checkpointing
        ):
            ran_checkpointed.add(id(module))
        effects.forwards[type(module).__name__] += 1
        if torch.is_autocast_enabled("cpu"):
            effects.autocast_forwards += 1

    def after(module, args, output):
        if torch.compiler.is_compiling():
            return
        if isinstance(module, (torch.nn.Linear, torch.nn.Conv2d)) and isinstance(output, torch.Tensor):
            effects.bfloat16_outputs += output.dtype == torch.bfloat16

    original_compile = torch.nn.Module.compile

    def compile_eagerly(module, *args, **kwargs):
        compiled.append(module)
        kwargs.pop("mode", None)
        return original_compile(module, *args, **{**kwargs, "backend": "eager"})

    torch._dynamo.reset()
    counters.clear()
    handles = [
        torch.nn.modules.module.register_module_forward_pre_hook(before),
        torch.nn.modules.module.register_module_forward_hook(after),
    ]
    torch.nn.Module.compile = compile_eagerly
    out = io.StringIO()
    environ = dict(os.environ)  # a script may set MASTER_PORT and the like: later tests must not inherit them
    try:
        with contextlib.redirect_stdout(out):
            effects.globals = runpy.run_path(str(path), run_name="__main__")
    finally:
        os.environ.clear()
        os.environ.update(environ)
        torch.nn.Module.compile = original_compile
        for handle in handles:
            handle.remove()
        effects.printed = out.getvalue()
        torch._dynamo.reset()

    effects.checkpointed = len(ran_checkpointed)
    effects.graphs = int(counters["stats"]["unique_graphs"])
    effects.compiled = sum(1 for m in compiled if m._compiled_call_impl is not None) if effects.graphs else 0
    models = [v for v in effects.globals.values() if isinstance(v, torch.nn.Module) and id(v) in modules]
    seen_parameters: set[int] = set()
    for model in models:
        effects.lora_layers += sum(1 for m in model.modules() if hasattr(m, "lora_A"))
        for module in model.modules():
            before_values = first_seen.get(id(module), {})
            for name, parameter in module.named_parameters(recurse=False):
                if id(parameter) in seen_parameters:
                    continue
                seen_parameters.add(id(parameter))
                moved = name in before_values and not torch.equal(before_values[name], parameter.detach())
                if parameter.requires_grad:
                    effects.trainable += parameter.numel()
                    effects.trainable_changed += moved
                else:
                    effects.frozen += parameter.numel()
                    if moved:
                        effects.frozen_changed.append(f"{type(module).__name__}.{name}")
    return effects
