"""What the engine's processes hand to the server: the launch check's verdict.

``python -m engine.launch RECIPE --check`` prints one JSON line, a :class:`LaunchVerdict` or a
:class:`LaunchRefusal`; the server (``sandbox.runs.check_launch``) reads it with
:func:`read_verdict`, the one parser of that line. The line is printed by a process that
imported the recipe's code, so the server validates it as untrusted input: strict models, no
field the engine does not write, a refusal naming the field that is wrong.

Torch-free (stdlib and pydantic), like :mod:`engine.run_dir`: the server imports it.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_serializer, model_validator

from engine.errors import LaunchRefused
from engine.run_dir import DataSummary

MAX_ERROR_CHARS = 2000  # a refusal's reason as the server shows it


class ConfigField(BaseModel):
    # One leaf key of a recipe's config (engine.config.describe_fields), as describe_recipe
    # shows it; keys it does not know are dropped. A comment, not a docstring: a docstring would
    # be its description in describe_recipe's output schema, which every tools/list carries.

    key: str
    type: str
    default: Any = None
    value: Any = Field(None, description="From config.yaml; absent: the default.")
    description: str = ""

    @model_validator(mode="before")
    @classmethod
    def _absent_value_is_the_default(cls, data: Any) -> Any:
        if isinstance(data, dict) and "value" not in data:
            data = {**data, "value": data.get("default")}
        return data

    @model_serializer(mode="wrap")
    def _value_only_when_set(self, handler: Any) -> dict[str, Any]:
        # Most keys of a recipe keep their default: saying it twice would take a tenth of the
        # result, which then cuts every description (the result stays under 8 KB).
        data = handler(self)
        if data.get("value") == data.get("default"):
            data.pop("value", None)
        return data


class LaunchVerdict(BaseModel):
    """A launch the engine accepts: the resolved ``config``, the keys that differ from the code
    defaults, every key described, the data summary (None: the recipe counts no data) and, with
    ``--estimate``, the run's estimate (``mcp_server.models.EstimateResult``)."""

    model_config = ConfigDict(extra="forbid")

    ok: Literal[True] = True
    config: dict[str, Any]
    config_changes: dict[str, Any] = {}
    fields: list[ConfigField] = []
    data: DataSummary | None = None
    estimate: dict[str, Any] | None = None


class LaunchRefusal(BaseModel):
    """A launch the engine refuses, and why (the message says what to change)."""

    model_config = ConfigDict(extra="forbid")

    ok: Literal[False] = False
    error: str


def read_verdict(stdout: str) -> LaunchVerdict | None:
    """The verdict on the check's output (its last line that is a JSON object with ``ok``), or
    None when it printed none. A refusal is raised as :class:`LaunchRefused` with its reason; a
    verdict with a field that is not the engine's as :class:`LaunchRefused` naming the field."""
    for line in reversed(stdout.strip().splitlines()):
        try:
            printed = json.loads(line)
        except (ValueError, RecursionError):  # not JSON, or nested too deep for the parser
            continue
        if not (isinstance(printed, dict) and "ok" in printed):
            continue
        if printed["ok"] is not True:
            error = printed.get("error")
            raise LaunchRefused(error[:MAX_ERROR_CHARS] if isinstance(error, str) and error
                                else "the launch check failed and gave no reason")
        try:
            return LaunchVerdict.model_validate(printed)
        except ValidationError as e:
            wrong = ".".join(str(part) for part in e.errors()[0]["loc"][:1]) or "verdict"
            raise LaunchRefused(f"the launch check's verdict has no valid {wrong!r}: the recipe's code printed a "
                                "verdict of its own, or the engine it imports is not trainwright's") from None
    return None
