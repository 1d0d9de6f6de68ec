"""What the GPU-kernel skills (liger-kernel, flash-attention) share: where their model stage goes
and how the code they write reports a feature it had to leave off.

The written helpers check for the GPU and the package at run time and take a ``warn`` callable:
in an engine recipe that is ``self.warn`` (one console line and an entry in run.json's
``warnings``, which ``get_run`` shows); in a script the helper prints one ``warning:`` line.
"""

from __future__ import annotations

import libcst as cst

from skills.codemod_kit import anchors, stages, templates
from skills.codemod_kit.anchors import ModelAnchor
from skills.codemod_kit.edits import Edits
from skills.codemod_kit.layout import MAX_LINE, one_argument_per_line
from skills.codemod_kit.recipe import Recipe
from skills.errors import SkillRefused

AUTOCAST = ("torch.autocast", "torch.amp.autocast", "torch.cuda.amp.autocast", "torch.amp.autocast_mode.autocast")


def in_engine(recipe: Recipe, model: ModelAnchor) -> bool:
    """Is the model built inside the recipe's Engine subclass (so ``self.warn`` exists)?"""
    engine = anchors.engine_class(recipe)
    return engine is not None and recipe.is_inside(model.statement, engine)


def warn_argument(recipe: Recipe, model: ModelAnchor) -> str:
    return ", warn=self.warn" if in_engine(recipe, model) else ""


def require_hf_model(recipe: Recipe, skill: str, model: ModelAnchor, why: str) -> None:
    if model.kind != "hf":
        raise SkillRefused(
            f"{skill}: the model is built by {model.builder}(...) ({recipe.where(model.statement)}), "
            f"{'a module defined in the file' if model.kind == 'custom' else 'not a Hugging Face class the codemod can see'}; {why}"
        )


def insert_kernel_stage(
    recipe: Recipe, edits: Edits, model: ModelAnchor, code: str, stage: int = stages.KERNELS
) -> None:
    """``code`` (one statement with one call, ``{model}`` for the model) right after the model is
    built and placed, before LoRA, tensor parallelism and every other wrapper; one argument per
    line when it does not fit on one. ``stage``: ``stages.KERNELS`` or ``stages.ATTENTION``."""
    statement = templates.statement(recipe.module, code, model=model.target)
    depth = sum(1 for a in recipe.ancestors(model.statement) if isinstance(a, cst.IndentedBlock))
    width = len(recipe.module.default_indent) * depth + len(recipe.module.code_for_node(statement).strip())
    if width > MAX_LINE:
        statement = statement.visit(_OneArgumentPerLine())
    stages.insert_stage(recipe, edits, model, stage, [statement])


class _OneArgumentPerLine(cst.CSTTransformer):
    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.Call:
        return one_argument_per_line(updated_node) if len(updated_node.args) > 1 else updated_node


def autocast_dtype(recipe: Recipe) -> str | None:
    """``torch.bfloat16``/``torch.float16`` when the file runs its forwards under autocast."""
    for call in recipe.calls_to(*AUTOCAST):
        dtype = anchors.keyword(call, "dtype")
        if dtype is not None:
            text = recipe.code(dtype.value)
            if text.endswith("bfloat16"):
                return "torch.bfloat16"
            if text.endswith(("float16", "half")):
                return "torch.float16"
    return None


def add_class_attribute(recipe: Recipe, edits: Edits, cls: cst.ClassDef, code: str) -> None:
    """A class-level statement after the class's docstring and ``config_class`` line."""
    body = list(cls.body.body)  # type: ignore[attr-defined]
    statement = templates.statement(recipe.module, code)
    anchor = None
    for item in body:
        if isinstance(item, cst.SimpleStatementLine) and all(
            isinstance(s, (cst.Expr, cst.Assign, cst.AnnAssign)) for s in item.body
        ):
            anchor = item
        else:
            break
    if anchor is not None:
        edits.insert_after(anchor, [statement])
    else:
        edits.insert_before(body[0], [statement])
