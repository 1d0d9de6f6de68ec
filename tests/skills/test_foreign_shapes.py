"""Skills on the shapes of training code people already have: a recipe class whose model and
optimizer are attributes built by factories, an accelerate loop, a Lightning Fabric loop, a
LightningModule, a Hugging Face Trainer script, a trainer class handed its model, a GAN (two
models: ``target`` picks one), a folder whose model lives in model.py, a GradScaler loop.

Snippets only: each test applies the skill (libcst, no torch) and asserts the change."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from skills import SkillRefused, apply_skill

RECIPE_CLASS = '''
from torchtune import config


class FullFinetuneRecipe:
    def __init__(self, cfg):
        self._device = cfg.device

    def setup(self, cfg):
        self._model = self._setup_model(cfg.model)
        self._optimizer = self._setup_optimizer(cfg.optimizer)
        self._loss_fn = config.instantiate(cfg.loss)

    def _setup_model(self, cfg_model):
        model = config.instantiate(cfg_model)
        model.to(self._device)
        return model

    def _setup_optimizer(self, cfg_optimizer):
        return config.instantiate(cfg_optimizer, self._model.parameters())

    def train(self):
        for batch in self._dataloader:
            logits = self._model(batch["tokens"])
            loss = self._loss_fn(logits, batch["labels"])
            loss.backward()
            self._optimizer.step()
            self._optimizer.zero_grad()
'''

ACCELERATE = '''
import torch
from accelerate import Accelerator
from transformers import AutoModelForCausalLM


def main(args):
    accelerator = Accelerator(gradient_accumulation_steps=2)
    if args.model_name_or_path:
        model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path)
    else:
        model = AutoModelForCausalLM.from_config(args.config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer, loader = accelerator.prepare(model, optimizer, args.loader)
    for batch in loader:
        with accelerator.accumulate(model):
            outputs = model(**batch)
            loss = outputs.loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
'''

FABRIC = '''
import lightning as L
import torch
from model import GPT


def main(cfg):
    fabric = L.Fabric(accelerator="cpu", devices=1)
    model = GPT(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = fabric.setup(model, optimizer)
    for x, y in fabric.setup_dataloaders(cfg.loader):
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits, y)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
'''

LIGHTNING = '''
import lightning as L
import torch
from litgpt import GPT


class LitModel(L.LightningModule):
    def __init__(self, cfg):
        super().__init__()
        self.model = GPT(cfg)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.model(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


trainer = L.Trainer(max_steps=2, gradient_clip_val=1.0)
trainer.fit(LitModel(cfg), loader)
'''

HF_TRAINER = '''
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

model = AutoModelForCausalLM.from_pretrained("gpt2")
args = TrainingArguments(
    output_dir="out",
    per_device_train_batch_size=8,
)
trainer = Trainer(model=model, args=args, train_dataset=dataset)
trainer.train()
'''

HANDED_MODEL = '''
import torch


class Trainer:
    def __init__(self, model, optimizers, loader):
        self.model = model
        self.optimizers = optimizers
        self.loader = loader

    def fit(self):
        for x, y in self.loader:
            loss = torch.nn.functional.mse_loss(self.model(x), y)
            loss.backward()
            self.optimizers.step()
            self.optimizers.zero_grad()
'''

SCALER = '''
import torch
from model import GPT

model = GPT(config)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler(enabled=dtype == "float16")
for step in range(max_iters):
    logits, loss = model(x, y)
    scaler.scale(loss).backward()
    if grad_clip != 0.0:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
'''

MODEL_PY = '''
import torch.nn as nn


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return x + self.fc(x)


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.h = nn.ModuleList([Block(config.width) for _ in range(config.n_layer)])

    def forward(self, x, y=None):
        for block in self.h:
            x = block(x)
        return x, x.sum()
'''


def write(tmp_path: Path, source: str, name: str = "train.py", **extra: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(source).lstrip())
    for other, text in extra.items():
        (tmp_path / other).write_text(textwrap.dedent(text).lstrip())
    return path


def added(diff: str) -> list[str]:
    return [line[1:].strip() for line in diff.splitlines() if line.startswith("+") and not line.startswith("+++")]


def removed(diff: str) -> list[str]:
    return [line[1:].strip() for line in diff.splitlines() if line.startswith("-") and not line.startswith("---")]


# --- a recipe class: factory-built model and optimizer held as attributes ---------------------


def test_recipe_class_gets_checkpointing_where_the_factory_builds_the_model(tmp_path: Path):
    path = write(tmp_path, RECIPE_CLASS)

    result = apply_skill("gradient-checkpointing", path)

    code = path.read_text()
    assert "        model.to(self._device)\n        checkpoint_blocks(model)\n        return model\n" in code
    assert "found at run time" in result.acts_on and "instantiate" in result.acts_on


def test_recipe_class_target_names_the_attribute(tmp_path: Path):
    path = write(tmp_path, RECIPE_CLASS)

    result = apply_skill("torch-compile", path, {"target": "self._model"})

    assert "        model.compile(mode=\"default\")\n        return model\n" in path.read_text()
    assert "`model`" in result.acts_on


def test_recipe_class_guards_the_attribute_optimizer_and_creates_the_guard_in_init(tmp_path: Path):
    path = write(tmp_path, RECIPE_CLASS)

    apply_skill("loss-guard", path)

    code = path.read_text()
    assert "    @cached_property\n    def loss_guard(self) -> LossGuard:\n        return LossGuard(" in code
    assert "            if self.loss_guard.check(loss, grad_norm):\n                self._optimizer.step()\n" in code
    assert "for g in self._optimizer.param_groups" in code


def test_recipe_class_autocasts_the_attribute_forward(tmp_path: Path):
    path = write(tmp_path, RECIPE_CLASS)

    apply_skill("mixed-precision", path)

    assert (
        '            with torch.autocast(device_type=batch["tokens"].device.type, dtype=torch.bfloat16):\n'
        '                logits = self._model(batch["tokens"])\n'
    ) in path.read_text()


# --- accelerate --------------------------------------------------------------------------------


def test_accelerate_mixed_precision_is_the_accelerator_argument(tmp_path: Path):
    path = write(tmp_path, ACCELERATE)

    result = apply_skill("mixed-precision", path)

    assert removed(result.diff) == ["accelerator = Accelerator(gradient_accumulation_steps=2)"]
    assert added(result.diff) == ['accelerator = Accelerator(gradient_accumulation_steps=2, mixed_precision="bf16")']
    assert apply_skill("mixed-precision", path).already_applied


def test_accelerate_with_kwargs_autocasts_the_forward_on_the_models_device(tmp_path: Path):
    path = write(tmp_path, ACCELERATE.replace("Accelerator(gradient_accumulation_steps=2)", "Accelerator(**kwargs)"))

    apply_skill("mixed-precision", path)

    assert (
        "            with torch.autocast(device_type=next(model.parameters()).device.type, dtype=torch.bfloat16):\n"
        "                outputs = model(**batch)\n"
    ) in path.read_text()


def test_accelerate_hf_model_built_in_two_branches_gets_its_own_checkpointing_after_both(tmp_path: Path):
    path = write(tmp_path, ACCELERATE)

    result = apply_skill("gradient-checkpointing", path)

    assert (
        "        model = AutoModelForCausalLM.from_config(args.config)\n"
        '    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})\n'
        "    optimizer = torch.optim.AdamW("
    ) in path.read_text()
    assert "gradient_checkpointing_enable" in result.acts_on


def test_accelerate_backward_gives_the_loss_to_the_guard(tmp_path: Path):
    path = write(tmp_path, ACCELERATE)

    apply_skill("loss-guard", path)

    code = path.read_text()
    assert "            if loss_guard.check(loss, grad_norm):\n                optimizer.step()\n" in code
    assert "    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)\n    loss_guard = LossGuard(" in code


# --- Lightning Fabric and LightningModule ------------------------------------------------------


def test_fabric_precision_and_backward(tmp_path: Path):
    path = write(tmp_path, FABRIC)

    mixed = apply_skill("mixed-precision", path)
    guard = apply_skill("loss-guard", path)

    assert added(mixed.diff) == ['fabric = L.Fabric(accelerator="cpu", devices=1, precision="bf16-mixed")']
    assert "if loss_guard.check(loss, grad_norm):" in path.read_text()
    assert guard.changed


def test_lightning_trainer_precision_and_training_step_guard(tmp_path: Path):
    path = write(tmp_path, LIGHTNING)

    mixed = apply_skill("mixed-precision", path)
    guard = apply_skill("loss-guard", path)

    assert added(mixed.diff) == ['trainer = L.Trainer(max_steps=2, gradient_clip_val=1.0, precision="bf16-mixed")']
    code = path.read_text()
    assert (
        '        self.log("train_loss", loss)\n'
        "        if not self.loss_guard.check(loss):\n"
        "            return None\n"
        "        return loss\n"
    ) in code
    assert "    @cached_property\n    def loss_guard(self) -> LossGuard:" in code
    assert "Lightning skips" in guard.acts_on


def test_lightning_module_checkpointing_finds_the_blocks_at_run_time(tmp_path: Path):
    path = write(tmp_path, LIGHTNING)

    result = apply_skill("gradient-checkpointing", path, {"target": "self.model"})

    assert "        self.model = GPT(cfg)\n        checkpoint_blocks(self.model)\n" in path.read_text()
    assert "found at run time" in result.acts_on


# --- Hugging Face Trainer ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "skill,argument",
    [("gradient-checkpointing", "gradient_checkpointing=True,"), ("mixed-precision", "bf16=True,"),
     ("torch-compile", "torch_compile=True,")],
)
def test_hf_trainer_gets_the_training_argument(skill: str, argument: str, tmp_path: Path):
    path = write(tmp_path, HF_TRAINER)

    result = apply_skill(skill, path)

    assert added(result.diff) == [argument]
    assert "TrainingArguments(...) at train.py:4" in result.acts_on
    assert apply_skill(skill, path).already_applied


def test_hf_trainer_has_no_loop_to_guard(tmp_path: Path):
    path = write(tmp_path, HF_TRAINER)

    with pytest.raises(SkillRefused, match=r"looked for .* found none; the loop belongs to the Hugging Face Trainer \(train.py:8\)"):
        apply_skill("loss-guard", path)


def test_training_argument_switched_by_a_variable_counts_as_there(tmp_path: Path):
    path = write(tmp_path, HF_TRAINER.replace('output_dir="out",', 'output_dir="out", bf16=args.bf16,'))

    result = apply_skill("mixed-precision", path)

    assert result.already_applied and "bf16=args.bf16" in result.message


# --- a trainer class handed its model, optimizers in a container -------------------------------


def test_handed_model_and_optimizer_container(tmp_path: Path):
    path = write(tmp_path, HANDED_MODEL)

    apply_skill("loss-guard", path)
    apply_skill("mixed-precision", path)

    code = path.read_text()
    assert "    @cached_property\n    def loss_guard(self) -> LossGuard:" in code
    assert "            if self.loss_guard.check(loss, grad_norm):\n                self.optimizers.step()\n" in code
    assert "with torch.autocast(device_type=x.device.type, dtype=torch.bfloat16):" in code


# --- the model in model.py, the loop in train.py ------------------------------------------------


def test_model_in_a_sibling_file_is_read_for_its_blocks(tmp_path: Path):
    path = write(tmp_path, SCALER, **{"model.py": MODEL_PY})

    result = apply_skill("gradient-checkpointing", path)

    assert result.acts_on == "wraps `config.n_layer` blocks of `model.h`"
    assert "model = GPT(config)\ncheckpoint_blocks(model)\noptimizer = " in path.read_text()


def test_without_the_sibling_file_the_whole_model_is_compiled(tmp_path: Path):
    path = write(tmp_path, SCALER)

    result = apply_skill("torch-compile", path)

    assert "model = GPT(config)\nmodel.compile(mode=\"default\")\n" in path.read_text()
    assert result.acts_on.startswith("compiles the whole model `model` (GPT): its class is not visible")


# --- GradScaler --------------------------------------------------------------------------------


def test_scaler_step_is_guarded_on_the_loss_and_keeps_update_valid(tmp_path: Path):
    path = write(tmp_path, SCALER)

    apply_skill("loss-guard", path)

    code = path.read_text()
    assert (
        "    if loss_guard.check(loss):\n"
        "        scaler.step(optimizer)\n"
        "    else:\n"
        "        unscale_once(scaler, optimizer)\n"
        "    scaler.update()\n"
    ) in code
    assert "def unscale_once(scaler, optimizer) -> None:" in code


# --- loop and target: pointing at one of several ------------------------------------------------


def test_loop_restricts_autocast_to_the_named_function(tmp_path: Path):
    source = HANDED_MODEL + '''
    def evaluate(self, x):
        return self.model(x)
'''
    path = write(tmp_path, source)

    result = apply_skill("mixed-precision", path, {"loop": "Trainer.fit"})

    assert result.acts_on.startswith("runs 1 forward call of `self.model`")
    assert "        return self.model(x)\n" in path.read_text()


def test_a_loop_line_of_another_file_is_refused(tmp_path: Path):
    path = write(tmp_path, HANDED_MODEL)

    with pytest.raises(SkillRefused, match=r"loop 'other.py:3' names other.py, but the skill works on train.py"):
        apply_skill("loss-guard", path, {"loop": "other.py:3"})


def test_none_found_lists_the_model_calls_it_saw(tmp_path: Path):
    path = write(tmp_path, "import torch\n\n\ndef step(model, x):\n    return model(x).sum()\n")

    with pytest.raises(SkillRefused) as refusal:
        apply_skill("gradient-checkpointing", path)

    message = str(refusal.value)
    assert message.startswith("gradient-checkpointing: looked for the model construction")
    assert "it calls a model (model(...) on line 5)" in message


# --- a GAN: two models, the skill goes on the one target names -------------------------------

GAN = Path(__file__).parent / "recipes" / "gan.py"


@pytest.mark.parametrize("skill", ["gradient-checkpointing", "torch-compile", "mixed-precision", "lora", "muon"])
def test_gan_without_target_lists_both_models(skill: str, tmp_path: Path):
    path = write(tmp_path, GAN.read_text())

    with pytest.raises(SkillRefused) as refusal:
        apply_skill(skill, path)

    message = str(refusal.value)
    assert "found several model constructions (`netG` at train.py:43 (`Generator()`), `netD` at train.py:44 " in message
    assert 'target="netG" or target="train.py:43"' in message
    assert path.read_text() == GAN.read_text()


@pytest.mark.parametrize("skill", ["gradient-checkpointing", "torch-compile"])
@pytest.mark.parametrize("target", ["netG", "train.py:43", "43"])
def test_gan_target_changes_the_generator_only(skill: str, target: str, tmp_path: Path):
    path = write(tmp_path, GAN.read_text())

    result = apply_skill(skill, path, {"target": target})

    helper = "checkpoint_blocks" if skill == "gradient-checkpointing" else "compile_blocks"
    calls = [line for line in added(result.diff) if line.startswith(helper + "(")]
    assert calls == [f"{helper}(netG)" if helper == "checkpoint_blocks" else f'{helper}(netG, mode="default")']
    assert not any("netD" in line for line in added(result.diff) + removed(result.diff))
    assert "3 blocks of `netG.blocks`" in result.acts_on


def test_gan_mixed_precision_on_the_discriminator_only(tmp_path: Path):
    path = write(tmp_path, GAN.read_text())

    result = apply_skill("mixed-precision", path, {"target": "netD"})

    wrapped = [line for line in removed(result.diff)]
    assert wrapped == ["d_real = netD(real)", "d_fake = netD(fake.detach())", "d_out = netD(fake)"]
    assert "fake = netG(torch.randn(16, noise_dim))\n" in path.read_text()
    assert "    fake = netG(" in path.read_text()  # not moved into a with block


def test_gan_loss_guard_target_names_one_optimizer(tmp_path: Path):
    path = write(tmp_path, GAN.read_text())

    apply_skill("loss-guard", path, {"target": "optG"})

    code = path.read_text()
    assert "    if loss_guard.check(loss_g, grad_norm):\n        optG.step()\n" in code
    assert "    optD.step()\n" in code


def test_gan_target_that_names_neither_lists_both(tmp_path: Path):
    path = write(tmp_path, GAN.read_text())

    with pytest.raises(SkillRefused, match=r"target 'critic' does not start with a model built in train.py; the model "
                                           r"constructions it saw: `netG` at train.py:43 .*`netD` at train.py:44"):
        apply_skill("freeze", path, {"target": "critic"})


# --- the backward pass inside a helper of the file --------------------------------------------


def test_backward_inside_a_method_that_returns_the_loss(tmp_path: Path):
    source = HANDED_MODEL.replace(
        "            loss = torch.nn.functional.mse_loss(self.model(x), y)\n            loss.backward()\n",
        "            loss = self.forward_backward(x, y)\n",
    ) + '''
    def forward_backward(self, x, y):
        loss = torch.nn.functional.mse_loss(self.model(x), y)
        loss.backward()
        return loss
'''
    path = write(tmp_path, source)

    apply_skill("loss-guard", path)

    assert "            if self.loss_guard.check(loss, grad_norm):\n                self.optimizers.step()\n" in path.read_text()


def test_backward_inside_a_helper_called_with_the_loss(tmp_path: Path):
    source = SCALER.replace("    scaler.scale(loss).backward()\n", "    backward(loss * 2, scaler)\n") + '''

def backward(total_loss, scaler):
    scaler.scale(total_loss).backward()
'''
    path = write(tmp_path, source)

    apply_skill("loss-guard", path)

    assert "    if loss_guard.check(loss):\n        scaler.step(optimizer)\n" in path.read_text()


def test_autocast_disabled_does_not_count_and_a_named_context_manager_does(tmp_path: Path):
    disabled = write(tmp_path, "@torch.autocast('cuda', enabled=False)\ndef f(x):\n    return x\n" + SCALER)
    assert apply_skill("mixed-precision", disabled).changed

    named = SCALER.replace("    logits, loss = model(x, y)\n", "    with autocast():\n        logits, loss = model(x, y)\n")
    result = apply_skill("mixed-precision", write(tmp_path, named, "named.py"))
    assert result.already_applied and "named.py:8" in result.message


def test_a_switch_set_by_a_flag_that_is_off_by_default_gets_the_default(tmp_path: Path):
    source = ACCELERATE.replace(
        "Accelerator(gradient_accumulation_steps=2)", "Accelerator(mixed_precision=args.mixed_precision)"
    ) + '''

parser = argparse.ArgumentParser()
parser.add_argument("--mixed_precision", type=str, default=None, choices=["no", "fp16", "bf16"])
'''
    path = write(tmp_path, source)

    result = apply_skill("mixed-precision", path)

    assert added(result.diff) == [
        'parser.add_argument("--mixed_precision", type=str, default="bf16", choices=["no", "fp16", "bf16"])'
    ]
    assert apply_skill("mixed-precision", path).already_applied


def test_transformer_encoder_layers_are_blocks_and_plain_attributes_are_not_submodules(tmp_path: Path):
    source = '''
import torch.nn as nn


class Transformer(nn.Module):
    def __init__(self, ninp, nlayers):
        super().__init__()
        self.ninp = ninp
        layer = nn.TransformerEncoderLayer(ninp, 2)
        self.transformer = nn.TransformerEncoder(layer, nlayers)
        self.decoder = nn.Linear(ninp, 10)


model = Transformer(16, 2)
'''
    path = write(tmp_path, source)

    result = apply_skill("gradient-checkpointing", path)

    assert result.acts_on == "wraps `nlayers` blocks of `model.transformer.layers`"
    assert added(result.diff)[-1] == "checkpoint_blocks(model, target=model.transformer.layers)"
    with pytest.raises(SkillRefused, match=r"its submodules are `transformer`, `decoder`$"):
        apply_skill("freeze", path, {"embeddings": False, "first_blocks": 1, "target": "model.ninp2"})


def test_model_built_by_the_base_class_setup(tmp_path: Path):
    source = '''
import torch as th


class PPO(OnPolicyAlgorithm):
    def _setup_model(self) -> None:
        super()._setup_model()
        self.clip_range = get_schedule_fn(self.clip_range)

    def train(self) -> None:
        for rollout_data in self.rollout_buffer.get(self.batch_size):
            values, log_prob, entropy = self.policy.evaluate_actions(rollout_data.observations, actions)
            loss = -log_prob.mean()
            self.policy.optimizer.zero_grad()
            loss.backward()
            th.nn.utils.clip_grad_norm_(self.policy.parameters(), self.max_grad_norm)
            self.policy.optimizer.step()
'''
    path = write(tmp_path, source)

    compiled = apply_skill("torch-compile", path)
    mixed = apply_skill("mixed-precision", path)
    guarded = apply_skill("loss-guard", path)

    assert added(compiled.diff) == ['self.policy.compile(mode="default")']
    assert "        self.clip_range = get_schedule_fn(self.clip_range)\n        self.policy.compile(" in path.read_text()
    assert removed(mixed.diff) == ["values, log_prob, entropy = self.policy.evaluate_actions(rollout_data.observations, actions)"]
    assert "if self.loss_guard.check(loss, grad_norm):" in path.read_text() and guarded.changed


def test_parsed_trl_arguments_get_gradient_checkpointing_after_the_parse(tmp_path: Path):
    source = '''
def main(script_args, training_args):
    trainer = SFTTrainer(model=script_args.model_name_or_path, args=training_args)
    trainer.train()


def make_parser():
    from trl import ScriptArguments, SFTConfig, TrlParser

    return TrlParser((ScriptArguments, SFTConfig))


if __name__ == "__main__":
    parser = make_parser()
    script_args, training_args = parser.parse_args_and_config()
    main(script_args, training_args)
'''
    path = write(tmp_path, source)

    result = apply_skill("gradient-checkpointing", path)

    assert added(result.diff) == ["training_args.gradient_checkpointing = True", "training_args.activation_checkpointing = True"]
    assert "    script_args, training_args = parser.parse_args_and_config()\n    training_args.gradient_checkpointing = True\n" in path.read_text()
    assert apply_skill("gradient-checkpointing", path).already_applied


def test_a_framework_switch_behind_configuration_counts_as_there_and_says_so(tmp_path: Path):
    source = '''
def build(config, model):
    parallelize(model, compile_config=config.compile, ac_config=config.activation_checkpoint)
    if config.compile_loss:
        loss_fn = torch.compile(loss_fn)
'''
    path = write(tmp_path, source)

    compiled = apply_skill("torch-compile", path)
    checkpointed = apply_skill("gradient-checkpointing", path)

    assert "torch.compile at train.py:4 (behind `if config.compile_loss:`" in compiled.message
    assert "`ac_config=config.activation_checkpoint` at train.py:2: turn it on" in checkpointed.message


def test_inherited_setup_and_the_model_that_owns_the_stepped_optimizer(tmp_path: Path):
    source = '''
import torch as th


class DQN(OffPolicyAlgorithm):
    def __init__(self, policy, env, _init_setup_model=True):
        super().__init__(policy, env)
        if _init_setup_model:
            self._setup_model()

    def _create_aliases(self) -> None:
        self.q_net = self.policy.q_net

    def train(self) -> None:
        for _ in range(self.gradient_steps):
            current_q_values = self.q_net(replay_data.observations)
            loss = th.nn.functional.smooth_l1_loss(current_q_values, target_q_values)
            self.policy.optimizer.zero_grad()
            loss.backward()
            th.nn.utils.clip_grad_norm_(self.policy.parameters(), self.max_grad_norm)
            self.policy.optimizer.step()
            self.save_model("x")
'''
    path = write(tmp_path, source)

    result = apply_skill("torch-compile", path)

    assert "        if _init_setup_model:\n            self._setup_model()\n            self.policy.compile(" in path.read_text()
    assert result.acts_on.startswith("compiles the whole model `self.policy`")


def test_nn_transformer_layers_are_blocks(tmp_path: Path):
    source = '''
import torch.nn as nn


class Seq2Seq(nn.Module):
    def __init__(self):
        super().__init__()
        self.transformer = nn.Transformer(d_model=16, nhead=2, num_encoder_layers=2, num_decoder_layers=3)


model = Seq2Seq()
'''
    result = apply_skill("gradient-checkpointing", write(tmp_path, source))

    path = tmp_path / "train.py"
    assert result.acts_on == (
        "wraps 2 blocks of `model.transformer.encoder.layers` and 3 blocks of `model.transformer.decoder.layers`"
    )
    assert added(result.diff)[-2:] == [
        "checkpoint_blocks(model, target=model.transformer.encoder.layers)",
        "checkpoint_blocks(model, target=model.transformer.decoder.layers)",
    ]
    compiled = apply_skill("torch-compile", path)
    assert added(compiled.diff) == ['model.compile(mode="default")']
    assert "torch.nn's own layers" in compiled.acts_on


def test_muon_replaces_the_optimizer_of_the_named_model_only(tmp_path: Path):
    path = write(tmp_path, GAN.read_text().replace("torch.optim.Adam(", "torch.optim.AdamW("))

    with pytest.raises(SkillRefused, match=r"found several model constructions \(`netG` at train.py:43"):
        apply_skill("muon", path)
    result = apply_skill("muon", path, {"target": "netG"})

    assert [line for line in removed(result.diff)] == ["optG = torch.optim.AdamW(netG.parameters(), lr=2e-4)"]


def test_a_pattern_behind_a_config_key_that_is_off_by_default_gets_it_on(tmp_path: Path):
    source = '''
from torchtune import config, training


class Recipe:
    def __init__(self, cfg):
        self._compile = cfg.get("compile", False)
        self._enable_activation_checkpointing = cfg.get("enable_activation_checkpointing", False)

    def _setup_model(self, cfg_model, enable_activation_checkpointing, compile_model):
        model = config.instantiate(cfg_model)
        if compile_model:
            training.compile_model(model)
        if enable_activation_checkpointing:
            training.set_activation_checkpointing(model, auto_wrap_policy={"TransformerSelfAttentionLayer"})
        return model
'''
    path = write(tmp_path, source)

    checkpointing = apply_skill("gradient-checkpointing", path)
    compiled = apply_skill("torch-compile", path)

    assert added(checkpointing.diff) == ['self._enable_activation_checkpointing = cfg.get("enable_activation_checkpointing", True)']
    assert added(compiled.diff) == ['self._compile = cfg.get("compile", True)']
    assert "a configuration that sets it to false still turns it off" in compiled.acts_on
    assert apply_skill("torch-compile", path).already_applied
