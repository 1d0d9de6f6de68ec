"""What a codemod returns: ``Edits`` to make, or ``AlreadyApplied``; refusals are raised."""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict


class SkillParams(BaseModel):
    """Base of every codemod's parameter model: unknown parameters are errors."""

    model_config = ConfigDict(extra="forbid")


@dataclass(frozen=True)
class AlreadyApplied:
    """The recipe already holds the pattern (written by the skill or by hand)."""

    reason: str
