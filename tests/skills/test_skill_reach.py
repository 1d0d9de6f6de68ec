"""What a change acts on: wrappers come after it, targets are checked, the written helpers
never do nothing quietly at run time."""

from __future__ import annotations

import importlib
import textwrap
from pathlib import Path

import pytest
import torch

from skills import SkillRefused, apply_skill
from skills.codemod_kit import copied
from skills.codemod_kit.definitions import FIND_BLOCKS
from skills.registry import skill as find_skill

MODEL = '''
import torch
import torch.nn as nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return x + self.fc(x)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(*[Block() for _ in range(4)])

    def forward(self, x):
        return self.layers(x)


'''

WRAPPED = {
    "accelerate": "model, optimizer = accelerator.prepare(model, optimizer)",
    "opacus": "model, optimizer, loader = privacy_engine.make_private(module=model, optimizer=optimizer, data_loader=loader)",
    "own wrapper": "model = PrivateWrapper(model)",
    "fsdp": "model = FullyShardedDataParallel(model)",
}


def script(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "train.py"
    path.write_text(MODEL + textwrap.dedent(body))
    return path


@pytest.mark.parametrize("wrapper", sorted(WRAPPED))
@pytest.mark.parametrize("skill", ["gradient-checkpointing", "torch-compile", "lora"])
def test_a_change_to_the_model_lands_before_its_wrapper(skill, wrapper, tmp_path: Path):
    line = WRAPPED[wrapper]
    order = ["model = Net()", line, "optimizer = torch.optim.SGD(model.parameters(), lr=0.1)"]
    if "optimizer" in line.split("=")[0]:  # accelerate/opacus wrap model and optimizer together
        order = ["model = Net()", "optimizer = torch.optim.SGD(model.parameters(), lr=0.1)", line]
    path = script(tmp_path, "\n".join(order) + "\nloss = model(torch.randn(2, 4)).sum()\nloss.backward()\noptimizer.step()\n")

    result = apply_skill(skill, path)

    lines = [x.strip() for x in path.read_text().splitlines()]
    call = next(i for i, x in enumerate(lines) if x.startswith(("checkpoint_blocks(", "compile_blocks(", "apply_lora(")))
    assert lines.index("model = Net()") < call < lines.index(line)
    assert "4 blocks of `model.layers`" in result.acts_on


def test_a_model_built_inside_its_wrapper_is_refused(tmp_path: Path):
    path = script(tmp_path, "model = DistributedDataParallel(Net())\n")
    with pytest.raises(SkillRefused, match=r"the model is built inside a wrapper \(train.py:\d+: .*\); a change to the "
                                           r"model must land before wrappers .*build it on a line of its own"):
        apply_skill("gradient-checkpointing", path)


def test_a_target_that_names_no_submodule_is_refused_with_the_submodules(tmp_path: Path):
    path = script(tmp_path, "model = Net()\n")
    with pytest.raises(SkillRefused, match=r"target 'model.blocks' names no submodule of Net; its submodules are `layers`"):
        apply_skill("gradient-checkpointing", path, {"target": "model.blocks"})
    with pytest.raises(SkillRefused, match=r"target 'other.layers' does not start with a model built in train.py; the model "
                       r"constructions it saw: `model` at train.py:\d+ \(`Net\(\)`\)"):
        apply_skill("torch-compile", path, {"target": "other.layers"})
    with pytest.raises(SkillRefused, match=r"target_modules \['proj'\] name no nn.Linear layer of Net .*: fc"):
        apply_skill("lora", path, {"target_modules": ["proj"]})


def _helpers(*names: str) -> dict:
    namespace = {"torch": torch}
    exec(FIND_BLOCKS, namespace)
    for name in names:
        codemod = find_skill(name).codemod
        for module, imported in copied.imports(codemod.HELPERS_MODULE):
            namespace[imported or module.split(".")[0]] = getattr(importlib.import_module(module), imported) \
                if imported else importlib.import_module(module.split(".")[0])
        exec(copied.definitions(codemod.HELPERS_MODULE), namespace)
    return namespace


class Flat(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 2, 3)
        self.head = torch.nn.Linear(2, 2)


def test_the_written_block_helpers_raise_on_a_model_without_blocks_and_warn_once_in_an_engine():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    helpers = _helpers("gradient-checkpointing", "torch-compile")
    helpers.update(CheckpointImpl=CheckpointImpl, apply_activation_checkpointing=apply_activation_checkpointing,
                   checkpoint_wrapper=checkpoint_wrapper)
    with pytest.raises(ValueError, match=r"^gradient-checkpointing: Flat has no repeated blocks"):
        helpers["checkpoint_blocks"](Flat())
    with pytest.raises(ValueError, match=r"^torch-compile: Flat has no repeated blocks"):
        helpers["compile_blocks"](Flat())

    warnings: list[str] = []
    assert helpers["checkpoint_blocks"](Flat(), warn=warnings.append) == 0
    assert warnings == ["gradient-checkpointing: Flat has no repeated blocks (an nn.ModuleList, or an nn.Sequential "
                        "of modules of one class), so the change does nothing; name the module to act on with the "
                        "skill's target parameter"]


def test_the_written_lora_helper_refuses_empty_targets_with_the_linear_layers_it_saw():
    from peft import LoraConfig, inject_adapter_in_model

    helpers = _helpers("lora")
    helpers.update(LoraConfig=LoraConfig, inject_adapter_in_model=inject_adapter_in_model)
    with pytest.raises(ValueError, match=r"^lora: no nn.Linear layer to adapt in Flat; its linear layers are \['head'\]"):
        helpers["apply_lora"](Flat())
    model = Flat()
    assert helpers["apply_lora"](model, rank=2, target_modules=["head"]) == 2 * 2 + 2 * 2


def test_find_blocks_names_where_the_blocks_are():
    helpers = _helpers()
    net = torch.nn.Module()
    net.trunk = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())  # mixed classes: not blocks
    net.stack = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(3)])
    where, blocks = helpers["find_blocks"](net, "test")
    assert where == "Module.stack" and len(blocks) == 3
    assert helpers["find_blocks"](net, "test", target=net.trunk) == ("Module.trunk", list(net.trunk))


def test_trainwright_apply_prints_what_the_change_acts_on(tmp_path: Path, capsys):
    from mcp_server.cli import main as cli_main

    script(tmp_path, "model = Net()\noptimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n")

    assert cli_main(["apply", "gradient-checkpointing", "train.py", "--workspace", str(tmp_path), "--dry-run"]) == 0

    out = capsys.readouterr().out
    assert "+checkpoint_blocks(model)\n" in out
    assert out.rstrip().endswith("acts on: wraps 4 blocks of `model.layers`")


APPENDED = '''
import torch
import torch.nn as nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return x + self.fc(x)


class Net(nn.Module):
    def __init__(self, depth=3):
        super().__init__()
        self.layers = nn.ModuleList()
        for _ in range(depth):
            self.layers.append(Block())

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


model = Net()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(2):
    loss = model(torch.randn(2, 4)).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    print(f"step {step} loss {loss.item():.6f}")
'''


def test_blocks_appended_to_a_module_list_are_counted_at_run_time(tmp_path: Path):
    from tests.skills.effect_probe import run_script

    path = tmp_path / "appended.py"
    path.write_text(APPENDED)

    checkpointing = apply_skill("gradient-checkpointing", path)
    lora = apply_skill("lora", path)
    effects = run_script(path)

    assert checkpointing.acts_on == "wraps the blocks (counted at run time) of `model.layers`"
    assert lora.acts_on == "adapts every nn.Linear in the blocks (counted at run time) of `model.layers` (named at run time)"
    assert effects.checkpointed == 3 and effects.lora_layers == 3 and effects.frozen_changed == []
    assert "gradient-checkpointing: wrapped 3 of 3 blocks of Net.layers" in effects.printed
