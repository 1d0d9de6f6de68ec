"""sequence-parallel: split every sequence over the ``sp`` ranks of the device mesh (Ulysses).

Anchors, in an engine recipe: the model construction inside the ``Engine`` subclass (a Hugging
Face decoder: its attention is swapped through transformers' ``AttentionInterface``) and the
subclass itself. The codemod writes two things, both calls into ``engine.sequence_parallel``:

- ``apply_sequence_parallel(model, self.dist.mesh["sp"])`` among the model stages, after the
  tensor-parallel stage and before freezing, activation checkpointing, ``torch.compile`` and
  FSDP2 (which then shards over ``dp`` × ``sp``);
- a ``to_device`` override that keeps this rank's part of every sequence
  (``shard_sequences``): the engine counts supervised tokens after it, so the loss stays
  normalised by the global token count.
"""

from __future__ import annotations

import libcst as cst

from skills.codemod_kit import AlreadyApplied, Edits, Recipe, SkillParams, anchors, pointing, reach, stages, templates
from skills.codemod_kit.anchors import keyword
from skills.errors import SkillRefused

SKILL = "sequence-parallel"
HELPERS = ("engine.sequence_parallel.apply_sequence_parallel", "engine.sequence_parallel.shard_sequences")


class Params(SkillParams):
    """The degree is the run's ``parallel.sp`` (1 changes nothing)."""

    target: str | None = pointing.target_field()


TO_DEVICE = '''
class _:
    def to_device(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The batch on the device, cut to this rank's part of every sequence when
        parallel.sp > 1 (the sequence-parallel skill): input ids, labels and position ids keep
        their global values, so RoPE and the per-document mask see where the part sits."""
        return shard_sequences(super().to_device(batch), self.dist.mesh["sp"])
'''


def apply(recipe: Recipe, params: Params) -> Edits | AlreadyApplied:
    existing = recipe.calls_to(*HELPERS)
    if existing:
        return AlreadyApplied(f"sequence parallelism at {recipe.where(existing[0])}")
    engine = anchors.engine_class(recipe)
    if engine is None:
        raise SkillRefused(
            f"{SKILL}: looked for a trainwright Engine subclass in {recipe.name}; found none. The sp "
            "mesh dimension, the split of each batch and the loss normalised over the sp ranks come "
            "from the engine; see SKILL.md: Doing it by hand"
        )
    model = pointing.find_model(recipe, SKILL, params.target)
    if model.kind != "hf":
        raise SkillRefused(
            f"{SKILL}: the model is built by {model.builder}(...) ({recipe.where(model.statement)}), "
            "a module defined in the file; its attention must be taught to run on all-to-all'd "
            "heads (see SKILL.md: Doing it by hand). The skill swaps the attention of Hugging Face "
            "decoders"
        )
    if not recipe.is_inside(model.statement, engine):
        raise SkillRefused(
            f"{SKILL}: the model is built at {recipe.where(model.statement)}, outside "
            f"{engine.name.value}; build it in prepare_model(), where self.dist.mesh is known"
        )
    forwards = anchors.forward_calls(recipe, model)
    for call in forwards:
        if keyword(call, "attention_mask") is not None:
            raise SkillRefused(
                f"{SKILL}: the forward call at {recipe.where(call)} passes attention_mask, which cannot "
                "be split with the sequence; pass position_ids instead (padding after the real tokens "
                "needs no mask; the sequence-packing skill does this), then apply again"
            )
        if keyword(call, "pixel_values") is not None:
            raise SkillRefused(
                f"{SKILL}: the forward call at {recipe.where(call)} passes pixel_values: a vision-language "
                "model puts each image's features at its image tokens, which a split of the sequence "
                "spreads over the ranks; shorten the sequence instead (gradient-checkpointing, "
                "sequence-packing) or shard with FSDP2 over more ranks"
            )
        if keyword(call, "labels") is not None:
            raise SkillRefused(
                f"{SKILL}: the forward call at {recipe.where(call)} passes labels=, so the model shifts "
                "them inside each rank's part of the sequence and loses the label at every cut; "
                "compute the loss from next-token labels laid out by the data, then apply again"
            )
    methods = recipe.methods(engine)
    if "to_device" in methods:
        raise SkillRefused(
            f"{SKILL}: {engine.name.value} already overrides to_device ({recipe.where(methods['to_device'])}); "
            "return shard_sequences(batch, self.dist.mesh[\"sp\"]) from it by hand"
        )

    edits = Edits(recipe)
    call = templates.statement(
        recipe.module, 'apply_sequence_parallel({model}, self.dist.mesh["sp"])', model=model.target
    )
    stages.insert_stage(recipe, edits, model, stages.SEQUENCE_PARALLEL, [call])
    method = templates.statements(recipe.module, TO_DEVICE)[0]
    new_members = [
        m.with_changes(leading_lines=[cst.EmptyLine(indent=False)])
        for m in method.body.body  # type: ignore[attr-defined]
    ]
    edits.replace(engine.body, lambda updated: updated.with_changes(body=[*updated.body, *new_members]))
    edits.add_import("torch")
    edits.add_import("engine.sequence_parallel", "apply_sequence_parallel")
    edits.add_import("engine.sequence_parallel", "shard_sequences")
    found = reach.shape(recipe, model)
    edits.acts_on = (
        f"splits every batch of {engine.name.value} along the sequence (to_device) and runs the attention "
        f"in {reach.describe_blocks(found)} on all-to-all'd heads over the sp mesh dimension (when sp > 1)"
    )
    edits.notes.append("launch with torchrun and --set parallel.sp=N (N divides the attention heads and data.seq_len)")
    return edits
