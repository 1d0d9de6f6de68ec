"""The training frameworks' own switches, where a skill's change is one argument.

A script that builds ``Accelerator(...)``, a Lightning ``Trainer(...)`` or ``Fabric(...)``, or
Hugging Face ``TrainingArguments(...)`` (and TRL's configs built on it) has a switch for mixed
precision, and the Hugging Face ones for activation checkpointing and ``torch.compile`` too. The
right change there is that argument (``bf16=True``, ``precision="bf16-mixed"``,
``mixed_precision="bf16"``), not code around the framework's own loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import libcst as cst

from skills.codemod_kit.anchors import keyword
from skills.codemod_kit.edits import Edits
from skills.codemod_kit.layout import fit_call, with_keyword
from skills.codemod_kit.recipe import Recipe

HF_ARGUMENTS = (
    ".TrainingArguments",
    ".Seq2SeqTrainingArguments",
    "trl.SFTConfig",
    "trl.DPOConfig",
    "trl.GRPOConfig",
    "trl.ORPOConfig",
    "trl.KTOConfig",
    "trl.CPOConfig",
    "trl.RewardConfig",
    "trl.PPOConfig",
    "trl.RLOOConfig",
    "trl.OnlineDPOConfig",
)
HF_TRAINERS = (".Trainer", ".Seq2SeqTrainer", "trl.SFTTrainer", "trl.DPOTrainer", "trl.GRPOTrainer",
               "trl.ORPOTrainer", "trl.KTOTrainer", "trl.RewardTrainer", "trl.PPOTrainer")
ACCELERATOR = ("accelerate.Accelerator", "accelerate.accelerator.Accelerator")
LIGHTNING_TRAINER = ("lightning.Trainer", "lightning.pytorch.Trainer", "pytorch_lightning.Trainer",
                     "lightning.pytorch.trainer.Trainer", "pytorch_lightning.trainer.Trainer")
FABRIC = ("lightning.Fabric", "lightning.fabric.Fabric", "lightning_fabric.Fabric")


@dataclass
class Switch:
    call: cst.Call
    framework: str  # "TrainingArguments", "Accelerator", "Lightning Trainer", "Fabric"
    name: str  # the argument
    value: str  # the code it is set to


def _calls(recipe: Recipe, names: tuple[str, ...]) -> list[cst.Call]:
    """Calls to one of ``names``; ``.Trainer`` matches transformers', not Lightning's."""
    found = []
    for call in recipe.calls_to(*names):
        qualified = recipe.call_name(call)
        if qualified in LIGHTNING_TRAINER or qualified.startswith(("lightning", "pytorch_lightning")):
            continue
        if names is HF_TRAINERS and not qualified.startswith(("transformers.", "trl.")):
            continue
        found.append(call)
    return found


def hf_arguments(recipe: Recipe) -> list[cst.Call]:
    return [c for c in _calls(recipe, HF_ARGUMENTS) if recipe.call_name(c).startswith(("transformers.", "trl."))
            or recipe.call_name(c).rsplit(".", 1)[-1].endswith("TrainingArguments")]


def hf_trainers(recipe: Recipe) -> list[cst.Call]:
    return _calls(recipe, HF_TRAINERS)


def accelerators(recipe: Recipe) -> list[cst.Call]:
    return recipe.calls_to(*ACCELERATOR)


def lightning_trainers(recipe: Recipe) -> list[cst.Call]:
    return recipe.calls_to(*LIGHTNING_TRAINER)


def fabrics(recipe: Recipe) -> list[cst.Call]:
    return recipe.calls_to(*FABRIC)


def switches(recipe: Recipe, feature: str) -> list[Switch]:
    """Where the frameworks in the file take ``feature`` ("bf16", "checkpointing", "compile")."""
    wanted: list[tuple[list[cst.Call], str, str, str]] = []
    if feature == "bf16":
        wanted = [
            (accelerators(recipe), "Accelerator", "mixed_precision", '"bf16"'),
            (lightning_trainers(recipe), "Lightning Trainer", "precision", '"bf16-mixed"'),
            (fabrics(recipe), "Fabric", "precision", '"bf16-mixed"'),
            (hf_arguments(recipe), "TrainingArguments", "bf16", "True"),
        ]
    elif feature == "checkpointing":
        wanted = [(hf_arguments(recipe), "TrainingArguments", "gradient_checkpointing", "True")]
    elif feature == "compile":
        wanted = [(hf_arguments(recipe), "TrainingArguments", "torch_compile", "True")]
    return [Switch(call, framework, name, value) for calls, framework, name, value in wanted for call in calls]


# Values that leave a switch off.
_OFF = {"None", "False", '"no"', "'no'", '"32"', "'32'", "32", '"32-true"', "'32-true'", '"fp32"', "'fp32'"}
# Arguments that already choose a precision (fp16 counts: the run is mixed precision already).
_PRECISION = {"bf16", "fp16", "half_precision_backend", "mixed_precision", "precision"}


def already_set(recipe: Recipe, switch: Switch, others: tuple[str, ...] = ()) -> cst.Arg | None:
    """The argument that already turns the feature on, or makes it configurable
    (``mixed_precision=args.mixed_precision``)."""
    for name in (switch.name, *others):
        arg = keyword(switch.call, name)
        if arg is not None and recipe.code(arg.value) not in _OFF:
            return arg
    return None


def precision_argument(recipe: Recipe, switch: Switch) -> cst.Arg | None:
    return already_set(recipe, switch, tuple(sorted(_PRECISION - {switch.name})))


def settable(switch: Switch) -> bool:
    """Can the argument be written without clashing (no ``**kwargs`` that may hold it)?"""
    return not any(a.star == "**" for a in switch.call.args)


def set_argument(recipe: Recipe, edits: Edits, switch: Switch) -> None:
    """``name=value`` in the call: replaces an existing ``name=<off>``, else appended."""
    value = cst.parse_expression(switch.value)
    existing = keyword(switch.call, switch.name)

    def change(updated: cst.Call, original: cst.Call = switch.call) -> cst.Call:
        if existing is not None:
            args = [a.with_changes(value=value) if a.keyword is not None and a.keyword.value == switch.name else a
                    for a in updated.args]
            return updated.with_changes(args=args)
        return fit_call(recipe, original, with_keyword(updated, switch.name, value))

    edits.replace(switch.call, change)


def describe(recipe: Recipe, switch: Switch) -> str:
    return f"`{switch.name}={switch.value}` in {switch.framework}(...) at {recipe.where(switch.call)}"


def set_already(recipe: Recipe, switches: list[Switch]) -> str | None:
    """Where one of ``switches`` already turns the feature on (an "already applied" message)."""
    for switch in switches:
        arg = already_set(recipe, switch)
        if arg is not None:
            return f"{switch.framework}(...) at {recipe.where(switch.call)} sets `{recipe.code(arg)}`"
    return None


def turn_on(recipe: Recipe, switches: list[Switch], effect: str) -> Edits:
    """One edit that sets each of ``switches``; ``acts_on`` names them, then ``effect``."""
    edits = Edits(recipe)
    for switch in switches:
        set_argument(recipe, edits, switch)
    edits.acts_on = "sets " + ", ".join(describe(recipe, s) for s in switches) + effect
    return edits


def command_line_flag(recipe: Recipe, value: cst.BaseExpression) -> cst.Call | None:
    """``parser.add_argument("--mixed_precision", ...)`` for ``args.mixed_precision``: the flag
    that sets a switch given as ``mixed_precision=args.mixed_precision``."""
    if not isinstance(value, cst.Attribute):
        return None
    attr = value.attr.value
    for call in recipe.method_calls("add_argument"):
        flags = [a.value.evaluated_value for a in call.args if a.keyword is None and isinstance(a.value, cst.SimpleString)]
        if any(isinstance(f, str) and f.lstrip("-").replace("-", "_") == attr for f in flags):
            return call
    return None


def flag_is_off(recipe: Recipe, flag: cst.Call) -> bool:
    """No default, or a default that leaves the switch off (None, "no", "fp32")."""
    if keyword(flag, "action") is not None:
        return False  # store_true and friends: a boolean the caller sets
    default = keyword(flag, "default")
    return default is None or recipe.code(default.value) in _OFF


def set_flag_default(recipe: Recipe, edits: Edits, flag: cst.Call, value: str) -> None:
    """``add_argument("--mixed_precision", default="bf16", ...)``: the flag keeps working."""
    switch = Switch(flag, "argparse", "default", value)
    set_argument(recipe, edits, switch)


PARSE_METHODS = {"parse_args_and_config", "parse_args_into_dataclasses", "parse_json_file", "parse_yaml_file",
                 "parse_dict"}


def _hf_arguments_class(recipe: Recipe, node: cst.BaseExpression) -> bool:
    name = recipe.qualify(node)
    return bool(name) and any(name == q or (q.startswith(".") and name.endswith(q)) for q in HF_ARGUMENTS)


def parsed_training_arguments(recipe: Recipe) -> list[tuple[cst.BaseStatement, str]]:
    """``script_args, training_args, ... = parser.parse_args_and_config()`` where the parser is an
    ``HfArgumentParser``/``TrlParser`` over ``(..., SFTConfig, ...)``: the statement and the name
    that holds the training arguments."""
    index = None
    for node in [a.value for a in recipe.assigns()] + [a.value for c in recipe.calls() for a in c.args]:
        if isinstance(node, (cst.Tuple, cst.List)):
            for position, element in enumerate(node.elements):
                if _hf_arguments_class(recipe, element.value):
                    index = position
    if index is None:
        return []
    found = []
    for call in recipe.calls():
        if not (isinstance(call.func, cst.Attribute) and call.func.attr.value in PARSE_METHODS):
            continue
        parent = recipe.parent(call)
        if not (isinstance(parent, cst.Assign) and len(parent.targets) == 1):
            continue
        target = parent.targets[0].target
        if isinstance(target, (cst.Tuple, cst.List)) and index < len(target.elements):
            element = target.elements[index].value
            if isinstance(element, cst.Name):
                found.append((recipe.statement_of(call), element.value))
    return found


def behind(recipe: Recipe, node: cst.CSTNode) -> str:
    """`` (behind `if cfg.compile:`: switch it on there)`` when ``node`` only runs under an ``if``."""
    for ancestor in recipe.ancestors(node):
        if isinstance(ancestor, cst.FunctionDef):
            return ""
        if isinstance(ancestor, cst.If):
            return f" (behind `if {recipe.short(ancestor.test, 50)}:`, so it runs only when that is on)"
    return ""


CONFIG_SWITCHES = {
    "checkpointing": ("ac_config", "activation_checkpoint", "activation_checkpointing", "activation_checkpoint_config",
                      "enable_activation_checkpointing", "gradient_checkpointing", "use_gradient_checkpointing"),
    "compile": ("compile_config", "compile", "torch_compile", "use_torch_compile", "compile_model"),
}


def config_switch(recipe: Recipe, feature: str) -> cst.Arg | None:
    """A framework's own switch handed its configuration: ``parallelize(model,
    compile_config=config.compile)``, ``ac_config=config.activation_checkpoint``."""
    names = CONFIG_SWITCHES[feature]
    for call in recipe.calls():
        for arg in call.args:
            if arg.keyword is not None and arg.keyword.value in names and isinstance(arg.value, (cst.Name, cst.Attribute)):
                return arg
    return None


def off_config_default(recipe: Recipe, words: tuple[str, ...]) -> cst.Arg | None:
    """``cfg.get("enable_activation_checkpointing", False)``: a configuration key of the feature
    whose default leaves it off (its ``False``)."""
    for call in recipe.method_calls("get"):
        args = [a for a in call.args if a.keyword is None]
        if len(args) == 2 and isinstance(args[0].value, cst.SimpleString) and recipe.code(args[1].value) == "False":
            key = args[0].value.evaluated_value
            if isinstance(key, str) and any(word in key for word in words):
                return args[1]
    return None


def turn_on_default(recipe: Recipe, edits: Edits, default: cst.Arg) -> str:
    """``False`` → ``True`` in that ``get``; says what it changed."""
    edits.replace(default.value, cst.Name("True"))
    call = recipe.parent(default)
    return (
        f"makes True the default of `{recipe.short(call, 60)}` at {recipe.where(default)}, which turns the "
        "pattern on (a configuration that sets it to false still turns it off)"
    )
