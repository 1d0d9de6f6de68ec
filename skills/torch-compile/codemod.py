"""torch-compile: compile the transformer blocks (or the whole model) in place with torch.compile.

Anchor: the model construction; the call goes after activation checkpointing and before FSDP2.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from skills.codemod_kit import (
    AlreadyApplied,
    Edits,
    Recipe,
    SkillParams,
    anchors,
    ensure_transformer_blocks,
    insert_definitions,
    stages,
    templates,
)

SKILL = "torch-compile"


class Params(SkillParams):
    scope: Literal["blocks", "model"] = Field(
        "blocks",
        description="'blocks': compile each transformer block (identical blocks share one graph; "
        "works with FSDP2 per-block sharding); 'model': compile the whole model.",
    )
    mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = Field(
        "default", description="torch.compile mode."
    )
    fullgraph: bool = Field(False, description="Fail on graph breaks instead of falling back to eager.")
    dynamic: bool | None = Field(None, description="Dynamic shapes: None lets torch decide.")


HELPER = '''
def compile_blocks(
    model: torch.nn.Module, mode: str = "default", fullgraph: bool = False, dynamic: bool | None = None
) -> None:
    """Compile every transformer block with torch.compile, in place (``Module.compile``), so
    parameter names and checkpoints stay as they are. Identical blocks share one compiled graph,
    and FSDP2 still shards and overlaps block by block. The first steps are slow while the
    graphs compile. Call it after activation checkpointing and before fully_shard.
    (Written by the torch-compile skill.)
    """
    for block in transformer_blocks(model):
        block.compile(mode=mode, fullgraph=fullgraph, dynamic=dynamic)
'''

def _existing(recipe: Recipe):
    """``torch.compile(...)``, our helper, or ``<module>.compile(...)`` (but not ``re.compile``)."""
    found = recipe.calls_to("torch.compile", "compile_blocks")
    if found:
        return found[0]
    for call in recipe.method_calls("compile"):
        if not recipe.call_name(call).startswith(("re.", "regex.")):
            return call
    return None


def apply(recipe: Recipe, params: Params) -> Edits | AlreadyApplied:
    existing = _existing(recipe)
    if existing is not None:
        return AlreadyApplied(f"torch.compile at {recipe.where(existing)}")
    model = anchors.find_model(recipe, SKILL)
    edits = Edits(recipe)
    options = [f"mode={templates.literal(params.mode)}"]
    if params.fullgraph:
        options.append("fullgraph=True")
    if params.dynamic is not None:
        options.append(f"dynamic={params.dynamic}")
    if params.scope == "model":
        call = templates.statement(recipe.module, f"{{model}}.compile({', '.join(options)})", model=model.target)
    else:
        ensure_transformer_blocks(recipe, edits, model.statement)
        insert_definitions(recipe, edits, HELPER, model.statement)
        edits.add_import("torch")
        call = templates.statement(recipe.module, f"compile_blocks({{model}}, {', '.join(options)})", model=model.target)
    stages.insert_stage(recipe, edits, model, stages.COMPILE, [call])
    edits.notes.append("the first steps include compilation (tens of seconds on CPU)")
    return edits
