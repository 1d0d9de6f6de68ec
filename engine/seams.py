"""What the engine's processes hand to the server: the launch check's verdict and the model
process's result.

``python -m engine.launch RECIPE --check`` prints one JSON line, a :class:`LaunchVerdict` or a
:class:`LaunchRefusal`; the server (``runner.lifecycle.check_launch``) reads it with
:func:`read_verdict`, the one parser of that line.

``python -m engine.model_io export|sample|evaluate`` writes one JSON object, an
:class:`ExportOutcome`, :class:`SampleOutcome` or :class:`EvaluateOutcome` (one per action), or
a :class:`ModelRefusal`; the server (``runner.model_process``) reads it with
:func:`read_model_result`, the one parser of that file.

Both are written by a process that imported the recipe's code, so the server validates them as
untrusted input: strict models, no field the engine does not write, every text and count
bounded, a refusal naming the field that is wrong.

Torch-free (stdlib and pydantic), like :mod:`engine.run_dir`: the server imports it.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_serializer, model_validator

from engine.errors import MAX_ERROR_CHARS, BadInput, LaunchRefused
from engine.run_dir import DataSummary

# What an export writes: a LoRA run's adapters merged or as a peft adapter; a Hugging Face folder,
# or instead one GGUF file (engine/gguf_export.py) of one of these types.
LORA_CHOICES = ("merged", "adapter")
GGUF_QUANTIZATIONS = ("f16", "f32", "bf16", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0")


class ConfigField(BaseModel):
    model_config = ConfigDict(defer_build=True)
    # One leaf key of a recipe's config (engine.config.describe_fields), as describe_recipe
    # shows it; keys it does not know are dropped. A comment, not a docstring: a docstring would
    # be its description in describe_recipe's output schema, which every tools/list carries.

    key: str
    type: str
    default: Any = None
    value: Any = Field(None, description="From config.yaml; absent: default.")
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

    model_config = ConfigDict(defer_build=True, extra="forbid")

    ok: Literal[True] = True
    config: dict[str, Any]
    config_changes: dict[str, Any] = {}
    fields: list[ConfigField] = []
    data: DataSummary | None = None
    estimate: dict[str, Any] | None = None


class LaunchRefusal(BaseModel):
    """A launch the engine refuses, and why (the message says what to change)."""

    model_config = ConfigDict(defer_build=True, extra="forbid")

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


# ---------------------------------------------------------------------------------------------
# The model process's result (engine.model_io, read by runner.model_process)
# ---------------------------------------------------------------------------------------------

MAX_PROMPTS = 8
MAX_PROMPT_CHARS = 4000
MAX_NEW_TOKENS = 512
MAX_COMPLETION_CHARS = 128 * MAX_NEW_TOKENS  # the decoded text of at most MAX_NEW_TOKENS tokens
MAX_SHOWN_CHARS = 4000  # what a recipe shows beside a sample (Engine.sample_inputs), cut by the engine
MAX_METRICS = 40  # task_metrics() kept, in the recipe's order
MAX_METRIC_NAME_CHARS = 100
MAX_NAME_CHARS = 100  # a tokenizer's class name
MAX_PATH_CHARS = 4096
MAX_DATA_PATHS = 20
MAX_TASKS = 8  # lm-eval tasks asked at once (engine.benchmarks)
MAX_TASK_NAME_CHARS = 100
MAX_TASK_SCORES = 40  # tasks and a group's subtasks scored, in lm-eval's order
MAX_COUNT = 2**63 - 1

Count = Annotated[int, Field(ge=0, le=MAX_COUNT)]


class ModelProcessFailed(BadInput):
    """The recipe's code failed while its model was loaded or asked; the message has its error."""


class _Seam(BaseModel):
    # Strict: a JSON value of another type is refused, not coerced; NaN and infinities too.
    model_config = ConfigDict(defer_build=True, extra="forbid", strict=True, allow_inf_nan=False)


class ModelRefusal(_Seam):
    """The model process refused (``bad_input``, ``not_found``) or the recipe's code failed
    (``failed``); ``error`` says why."""

    ok: Literal[False] = False
    kind: Literal["bad_input", "not_found", "failed"]
    error: str = Field(max_length=MAX_ERROR_CHARS)


class ExportOutcome(_Seam):
    """A Hugging Face folder or a GGUF file written (``engine.hf_export``, ``engine.gguf_export``)."""

    action: ClassVar[str] = "export"
    ok: Literal[True] = True
    step: Count
    lora: Literal["merged", "adapter"] | None = None
    lora_layers: Count = 0
    base_model: str | None = Field(None, max_length=MAX_PATH_CHARS)  # an adapter's base, as adapter_config names it
    tokenizer: str | None = Field(None, max_length=MAX_NAME_CHARS)
    parameters: Count
    gguf: Literal[GGUF_QUANTIZATIONS] | None = None  # type: ignore[valid-type]


class GeneratedSample(_Seam):
    """One prompt and its continuation; ``input`` and ``expected`` are what the recipe shows
    beside it (``Engine.sample_inputs``); ``raw``, ``reasoning`` and ``tool_calls``: a chat
    model's completion as written, parsed."""

    prompt: str = Field(max_length=MAX_PROMPT_CHARS)
    input: str | None = Field(None, max_length=MAX_SHOWN_CHARS)
    expected: str | None = Field(None, max_length=MAX_SHOWN_CHARS)
    completion: str = Field(max_length=MAX_COMPLETION_CHARS)
    new_tokens: Annotated[int, Field(ge=0, le=MAX_NEW_TOKENS)]
    stopped: Literal["eos", "max_new_tokens"]
    # A chat model's completion as written (special tokens kept) beside the parsed one:
    # ``completion`` is then its answer, less its reasoning and its calls (engine.chat.parse_completion).
    raw: str | None = Field(None, max_length=MAX_COMPLETION_CHARS)
    reasoning: str | None = Field(None, max_length=MAX_COMPLETION_CHARS)
    tool_calls: list[dict[str, Any]] | None = Field(None, max_length=MAX_NEW_TOKENS)


class SampleOutcome(_Seam):
    """Continuations of the prompts, in their order."""

    action: ClassVar[str] = "sample"
    ok: Literal[True] = True
    step: Count
    temperature: Annotated[float, Field(ge=0, le=5)]
    chat: bool
    samples: list[GeneratedSample] = Field(max_length=MAX_PROMPTS)


class TaskScore(_Seam):
    """One lm-eval task's metrics (``acc``; a filter other than ``none`` kept: ``exact_match,strict-match``),
    their stderr where lm-eval computes one, and the examples scored (``engine.benchmarks``)."""

    task: str = Field(max_length=MAX_TASK_NAME_CHARS)
    examples: Count | None
    metrics: dict[Annotated[str, Field(max_length=MAX_METRIC_NAME_CHARS)], float] = Field(max_length=MAX_METRICS)
    stderr: dict[Annotated[str, Field(max_length=MAX_METRIC_NAME_CHARS)], float] = Field(max_length=MAX_METRICS)


class EvaluateOutcome(_Seam):
    """The eval loss of a checkpoint (None: not finite) and the recipe's task metrics (finite
    values only); ``examples``, ``tokens``, ``loss_tokens``: the split as its data summary
    counts it (None: the recipe counts no data). ``split="tasks"``: lm-eval's scores in
    ``tasks``, and no loss."""

    action: ClassVar[str] = "evaluate"
    ok: Literal[True] = True
    step: Count
    eval_loss: float | None
    perplexity: Annotated[float, Field(ge=0)] | None
    batches: Count
    split: Literal["held_out", "data", "tasks"]
    examples: Count | None = None
    tokens: Count | None = None
    loss_tokens: Count | None = None
    scored_tokens: Count
    data: list[Annotated[str, Field(max_length=MAX_PATH_CHARS)]] | None = Field(None, max_length=MAX_DATA_PATHS)
    metrics: dict[Annotated[str, Field(max_length=MAX_METRIC_NAME_CHARS)], float] = Field({}, max_length=MAX_METRICS)
    tasks: list[TaskScore] = Field([], max_length=MAX_TASK_SCORES)


ModelOutcome = ExportOutcome | SampleOutcome | EvaluateOutcome
MAX_PROGRESS_BYTES = 64 * 1024  # of the progress file, read by the server
MAX_PROGRESS_CHARS = 200


class ModelProgress(_Seam):
    """How far the model process got, a line of its own appended as it goes to the file
    ``--progress`` names (``evaluate --task``: in task ``done`` of ``total``, ``message`` naming
    it); the server sends each on as the call's progress."""

    done: Count
    total: Annotated[int, Field(ge=1, le=MAX_COUNT)]
    message: str = Field(max_length=MAX_PROGRESS_CHARS)


def read_model_progress(written: bytes) -> ModelProgress | None:
    """One line of the model process's progress file; None for anything that is not one."""
    try:
        return ModelProgress.model_validate_json(written)
    except ValidationError:
        return None
OUTCOMES: dict[str, type[ExportOutcome] | type[SampleOutcome] | type[EvaluateOutcome]] = {
    model.action: model for model in (ExportOutcome, SampleOutcome, EvaluateOutcome)}
# The names a refusal may show: a field's, never a key the recipe chose (a metric's name).
_FIELD_NAMES = frozenset(name for model in (ModelRefusal, GeneratedSample, TaskScore, *OUTCOMES.values()) for name in model.model_fields)


def read_model_result(action: str, written: bytes) -> ModelOutcome | ModelRefusal | None:
    """The model process's result for ``action`` from what it wrote (one JSON object with
    ``ok``), or None when it wrote none. A result or refusal with a field that is not the
    engine's (a wrong type, a field it does not write, one missing, a text or count beyond its
    bound) is raised as :class:`ModelProcessFailed` naming the field."""
    try:
        written_object = json.loads(written)
    except (ValueError, RecursionError):  # not JSON, or nested too deep for the parser
        return None
    if not (isinstance(written_object, dict) and "ok" in written_object):
        return None
    model = ModelRefusal if written_object["ok"] is not True else OUTCOMES[action]
    try:
        return model.model_validate(written_object)
    except ValidationError as e:
        raise ModelProcessFailed(f"the {action} result {_what_is_wrong(e)}: the recipe's code wrote a result of its "
                                 "own, or the engine it imports is not trainwright's; nothing was changed") from None


def _what_is_wrong(error: ValidationError) -> str:
    """The first error, naming its field by its dotted place (``samples.0.completion``): up to
    the first part that is not a field's name or a list index (a key the recipe chose, such as a
    metric's name, is not shown), or, for a field the engine does not write, that name, cut."""
    first = error.errors()[0]
    loc = list(first["loc"])
    extra = first["type"] == "extra_forbidden" and bool(loc)
    parts = []
    for part in loc[:-1] if extra else loc:
        if not (isinstance(part, int) or part in _FIELD_NAMES):
            break
        parts.append(str(part))
    if extra:
        return f"has a field the engine does not write: {'.'.join([*parts, str(loc[-1])[:40]])!r}"
    field = ".".join(parts) or "result"
    if first["type"] == "missing":
        return f"has no {field!r}"
    return f"has no valid {field!r} ({first['msg'][:200]})"
