"""Configuration: pydantic models, layered as code defaults → ``config.yaml`` → ``--set`` overrides.

A recipe subclasses :class:`EngineConfig` to add its own sections (``model``, richer ``data``)
and keeps every default in code. Every model forbids unknown keys, so a typo stops the launch
with a message that names the key and the valid choices, before anything is written.
"""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from types import UnionType
from typing import Any, Literal, Mapping, Sequence, Union, get_args, get_origin
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from engine.errors import BadInput


class ConfigError(BadInput):
    """A configuration that cannot be used; the message says which key and what is allowed."""


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, and assignments are validated."""

    model_config = ConfigDict(defer_build=True, extra="forbid", validate_assignment=True)

    def undescribed(self) -> set[str]:
        """Fields that ``describe_fields`` leaves out as things stand (they are still valid keys):
        settings of something the config does not use, kept out of what an agent reads."""
        return set()


class TrainConfig(Section):
    max_steps: int = Field(200, ge=1, description="Optimizer steps to train for.")
    seed: int = Field(0, ge=0, description="Seeds weights, data order, every RNG.")
    log_every: int = Field(10, ge=1, description="Log every N steps.")
    grad_accum: int = Field(1, ge=1, description="Micro-batches per optimizer step.")
    max_grad_norm: float | None = Field(
        1.0, gt=0, description="Gradient norm clip (null: off)."
    )
    eval_every: int = Field(0, ge=0, description="Evaluate every N steps; 0 never.")
    eval_batches: int = Field(4, ge=1, description="Batches per evaluation.")


class OptimConfig(Section):
    name: Literal["adamw", "adamw_8bit"] = Field(
        "adamw",
        description="adamw (fused) or adamw_8bit (bitsandbytes).",
    )
    lr: float = Field(1e-3, gt=0, description="Peak learning rate.")
    weight_decay: float = Field(0.1, ge=0, description="AdamW's weight decay.")
    beta1: float = Field(0.9, ge=0, lt=1, description="AdamW beta1.")
    beta2: float = Field(0.95, ge=0, lt=1, description="AdamW beta2.")
    eps: float = Field(1e-8, gt=0, description="AdamW epsilon.")
    warmup_steps: int = Field(20, ge=0, description="Linear warm-up steps.")
    min_lr_ratio: float = Field(
        0.1, ge=0, le=1, description="Cosine floor, a fraction of peak lr."
    )


class DataConfig(Section):
    batch_size: int = Field(
        8, ge=1, description="Global sequences per optimizer step."
    )
    seq_len: int = Field(256, ge=2, description="Tokens per sequence.")


class CheckpointConfig(Section):
    every: int = Field(100, ge=0, description="Save every N steps (0: at the end).")
    keep_last: int = Field(2, ge=1, description="Checkpoints to keep.")
    at_end: bool = Field(True, description="Checkpoint at the end.")


DType = Literal["float32", "bfloat16", "float16"]


class ParallelConfig(Section):
    tp: int = Field(1, ge=1, description="Tensor-parallel degree (rest: data parallel).")
    sp: int = Field(
        1, ge=1, description="Sequence-parallel degree (see its skill)."
    )
    param_dtype: DType = Field(
        "float32", description="Dtype FSDP2 computes in."
    )
    reduce_dtype: DType = Field(
        "float32", description="Gradient reduce-scatter dtype."
    )
    fsdp_on_one_process: bool = Field(
        False,
        description="fully_shard on one dp rank too (adds copies).",
    )
    cpu_offload: bool = Field(
        False,
        description="Params, grads, optimizer state in RAM (CUDA).",
    )


class WandbConfig(Section):
    mode: Literal["offline", "online"] = Field(
        "offline", description="offline: files in the run dir; online: needs network and WANDB_API_KEY."
    )
    project: str = Field("trainwright", min_length=1, max_length=128, description="W&B project.")
    entity: str | None = Field(None, description="W&B entity.")
    run_name: str | None = Field(None, description="null: the run id.")
    group: str | None = Field(None, description="W&B run group.")
    tags: list[str] = Field([], description="W&B run tags.")


class MlflowConfig(Section):
    tracking_uri: str | None = Field(None, description="null: SQLite in the run dir; a server needs network.")
    experiment: str = Field("trainwright", min_length=1, max_length=256, description="MLflow experiment.")
    run_name: str | None = Field(None, description="null: the run id.")

    @field_validator("tracking_uri")
    @classmethod
    def _no_credentials(cls, uri: str | None) -> str | None:
        if uri is not None and urlsplit(uri).password:
            raise ValueError(
                "a tracking URI must not hold a password (run.json keeps the config): set "
                "MLFLOW_TRACKING_USERNAME/MLFLOW_TRACKING_PASSWORD or MLFLOW_TRACKING_TOKEN and list "
                "them in runs.pass_env"
            )
        return uri


class TrackioConfig(Section):
    project: str = Field("trainwright", min_length=1, max_length=128, description="trackio project.")
    run_name: str | None = Field(None, description="null: the run id.")
    space_id: str | None = Field(None, description="A HF Space to log to; null: a store in the run dir.")


MetricsBackendName = Literal["wandb", "mlflow", "trackio"]


class MetricsConfig(Section):
    tensorboard: bool = Field(True, description="TensorBoard events (if installed).")
    peak_tflops: float | None = Field(
        None, gt=0, description="Peak TFLOP/s, for MFU (GPUs: looked up)."
    )
    backends: list[MetricsBackendName] = Field(
        [], description="Also log here (keys: metrics.<name>.*)."
    )
    wandb: WandbConfig = WandbConfig()
    mlflow: MlflowConfig = MlflowConfig()
    trackio: TrackioConfig = TrackioConfig()

    def undescribed(self) -> set[str]:
        return {"wandb", "mlflow", "trackio"} - set(self.backends)


class EngineConfig(Section):
    """The sections every recipe has. Recipes subclass this and add their own."""

    train: TrainConfig = TrainConfig()
    optim: OptimConfig = OptimConfig()
    data: DataConfig = DataConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    parallel: ParallelConfig = ParallelConfig()
    metrics: MetricsConfig = MetricsConfig()


# ---------------------------------------------------------------------------------------------
# Layering
# ---------------------------------------------------------------------------------------------


MAX_OVERRIDES = 64
MAX_OVERRIDE_CHARS = 512
MAX_CONFIG_DEPTH = 8

Overrides = Mapping[str, Any] | Sequence[str] | None


def parse_override(text: str) -> tuple[str, Any]:
    """``"train.max_steps=50"`` → ``("train.max_steps", 50)``.

    The value is read as YAML (so ``null``, ``true``, ``[1, 2]`` work); pydantic then coerces it
    to the field's type, so ``1e-3`` becomes a float even though YAML reads it as a string.
    """
    if not isinstance(text, str):
        raise ConfigError(f"an override must be a 'key=value' string, got {type(text).__name__}")
    key, sep, raw_value = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"an override must be key=value with a dotted key, got {text[:80]!r}")
    try:
        value = yaml.safe_load(raw_value) if raw_value.strip() else ""
    except yaml.YAMLError:
        value = raw_value
    return _checked_key(key.strip()), value


def _checked_key(key: object) -> str:
    if not isinstance(key, str) or not key:
        raise ConfigError(f"config key {key!r} must be a non-empty dotted string like 'train.max_steps'")
    if "=" in key or "\x00" in key or len(key) > 200 or any(not part for part in key.split(".")):
        raise ConfigError(f"config key {key[:80]!r} must be a dotted key like 'train.max_steps'")
    return key


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"train": {"max_steps": 5}}`` → ``{"train.max_steps": 5}`` (dotted keys pass through)."""
    if prefix.count(".") >= MAX_CONFIG_DEPTH:
        raise ConfigError(f"config is nested deeper than {MAX_CONFIG_DEPTH} levels")
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        key = _checked_key(key)
        if isinstance(value, Mapping) and value:
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def nest(flat: Mapping[str, Any]) -> dict[str, Any]:
    """``{"train.max_steps": 5}`` → ``{"train": {"max_steps": 5}}``."""
    tree: dict[str, Any] = {}
    for key, value in flat.items():
        *parents, leaf = key.split(".")
        node = tree
        for part in parents:
            child = node.get(part)
            if not isinstance(child, dict):
                child = node[part] = {}
            node = child
        node[leaf] = value
    return tree


def deep_merge(base: Mapping[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    """``update`` over ``base``; sections merge key by key, everything else is replaced."""
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def overrides_to_dict(overrides: Overrides) -> dict[str, Any]:
    """The one reader of overrides, whatever their form, into flat dotted keys → values.

    ``{"train.max_steps": 50}``, ``{"train": {"max_steps": 50}}`` and ``["train.max_steps=50"]``
    all give ``{"train.max_steps": 50}``. The CLI (``--set``, ``--config``), the MCP tools and
    the engine's ``--set`` go through here.
    """
    if overrides is None:
        return {}
    if isinstance(overrides, Mapping):
        flat = flatten(overrides)
    elif isinstance(overrides, Sequence) and not isinstance(overrides, (str, bytes)):
        flat = {}
        for item in overrides:
            if isinstance(item, str) and len(item) > MAX_OVERRIDE_CHARS:
                raise ConfigError(f"override {item[:60]!r}… is longer than {MAX_OVERRIDE_CHARS} characters")
            key, value = parse_override(item)
            flat[key] = value
    else:
        raise ConfigError("overrides must be a mapping of dotted config keys to values, or 'key=value' strings")
    if len(flat) > MAX_OVERRIDES:
        raise ConfigError(f"at most {MAX_OVERRIDES} config overrides")
    for key, value in flat.items():
        if len(json.dumps(value, default=str)) > MAX_OVERRIDE_CHARS:
            raise ConfigError(f"the value of {key} is longer than {MAX_OVERRIDE_CHARS} characters")
    return flat


def override_args(flat: Mapping[str, Any]) -> list[str]:
    """Flat overrides → ``key=value`` strings for ``engine.launch --set`` (values as JSON,
    which YAML reads back unchanged)."""
    return [f"{key}={json.dumps(value)}" for key, value in flat.items()]


def load_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of sections at the top level")
    return data


def build_config(
    config_class: type[EngineConfig],
    yaml_path: Path | None = None,
    overrides: Overrides = (),
    base: Mapping[str, Any] | None = None,
) -> EngineConfig:
    """Code defaults, then ``base`` (a resumed run's config) or the YAML file (if it exists),
    then overrides, validated once."""
    layered: dict[str, Any] = dict(base or {})
    if yaml_path is not None and Path(yaml_path).is_file():
        layered = deep_merge(layered, load_yaml(yaml_path))
    layered = deep_merge(layered, nest(overrides_to_dict(overrides)))
    try:
        return config_class.model_validate(layered)
    except ValidationError as e:
        raise ConfigError(explain_validation_error(config_class, e)) from None


def config_changes(config: EngineConfig) -> dict[str, Any]:
    """Every dotted key whose value differs from the recipe's code default, as built: with
    ``model.pretrained_path``, the model keys its config.json gives are that model's
    (:func:`pretrained_model_keys`), not the recipe's unused sizes."""
    try:
        defaults = config_keys(type(config)())
    except ValidationError:  # a config class with required keys has no full default
        defaults = {}
    built = {**config_keys(config, json_mode=True), **pretrained_model_keys(config)}
    return {
        key: value for key, value in built.items()
        if key not in defaults or _jsonable(defaults[key]) != value
    }


# A recipe's model key -> the names a Hugging Face config.json gives it under.
PRETRAINED_CONFIG_NAMES: dict[str, tuple[str, ...]] = {
    "hidden_size": ("hidden_size", "n_embd", "d_model"),
    "intermediate_size": ("intermediate_size", "n_inner"),
    "num_layers": ("num_hidden_layers", "n_layer", "num_layers"),
    "num_heads": ("num_attention_heads", "n_head"),
    "num_kv_heads": ("num_key_value_heads",),
    "rope_theta": ("rope_theta",),
    "vocab_size": ("vocab_size",),
}
MAX_PRETRAINED_CONFIG_BYTES = 4 * 2**20


def pretrained_model_keys(config: BaseModel) -> dict[str, Any]:
    """``{"model.hidden_size": 256, ...}``: the model keys of a config whose ``model.pretrained_path``
    names a local folder with a config.json, as that model has them (what is built); empty
    otherwise. A recipe's sizes of those keys are unused then (:func:`describe_fields` says so)."""
    model = getattr(config, "model", None)
    path = getattr(model, "pretrained_path", None)
    if not isinstance(model, BaseModel) or not isinstance(path, str) or not path:
        return {}
    hf_config = _pretrained_config(path)
    if not hf_config:
        return {}
    sources = [hf_config] + [hf_config[k] for k in ("text_config",) if isinstance(hf_config.get(k), dict)]
    rope = hf_config.get("rope_parameters")
    if isinstance(rope, dict):  # transformers 5 keeps rope_theta there
        sources.append(rope)
    built: dict[str, Any] = {}
    for name in type(model).model_fields:
        for source in sources:
            value = next((source[n] for n in PRETRAINED_CONFIG_NAMES.get(name, ()) if n in source), None)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                built[f"model.{name}"] = value
                break
    return built


def _pretrained_config(path: str) -> dict[str, Any] | None:
    """The config.json of a local model folder (confined like every data path), or of the
    snapshot the server bound for a Hub id; None where there is none."""
    from engine.data_files import HUB_MODELS_VARIABLE, bound_hub_path, confined_file

    try:
        config_file = confined_file(Path(path) / "config.json")
        if config_file is None:
            bound = bound_hub_path(HUB_MODELS_VARIABLE, path)  # in the Hugging Face cache, bound read-only
            config_file = Path(bound) / "config.json" if bound is not None else None
        if config_file is None or not config_file.is_file():
            return None
        with open(config_file, "rb") as f:
            data = json.loads(f.read(MAX_PRETRAINED_CONFIG_BYTES))
    except (OSError, ValueError, BadInput):
        return None
    return data if isinstance(data, dict) else None


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def _field_names(model_class: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """The valid keys at ``loc`` (the parent of the offending key)."""
    current: Any = model_class
    for part in loc:
        field = getattr(current, "model_fields", {}).get(part)
        if field is None:
            return []
        current = field.annotation
    return sorted(getattr(current, "model_fields", {}))


def explain_validation_error(model_class: type[BaseModel], error: ValidationError) -> str:
    lines = []
    for item in error.errors():
        loc = tuple(str(p) for p in item["loc"])
        key = ".".join(loc)
        if item["type"] == "extra_forbidden":
            parent = loc[:-1]
            valid = _field_names(model_class, parent)
            where = f" in '{'.'.join(parent)}'" if parent else ""
            hint = difflib.get_close_matches(loc[-1], valid, n=1)
            suggestion = f" (did you mean '{'.'.join(parent + (hint[0],))}'?)" if hint else ""
            lines.append(
                f"unknown config key '{key}'{suggestion}; valid keys{where}: {', '.join(valid)}"
            )
        elif item["type"] in ("model_type", "model_attributes_type", "dict_type"):
            valid = _field_names(model_class, loc)
            lines.append(f"config key '{key}' is a section; set one of its keys: {', '.join(valid)}")
        else:
            value = item.get("input")
            lines.append(f"bad value for config key '{key}': {value!r}: {item['msg']}")
    return "; ".join(lines)


def config_keys(config: BaseModel, prefix: str = "", json_mode: bool = False) -> dict[str, Any]:
    """Flatten a config into dotted keys → values (for printing and for run.json summaries)."""
    flat: dict[str, Any] = {}
    for name in type(config).model_fields:
        value = getattr(config, name)
        key = f"{prefix}{name}"
        if isinstance(value, BaseModel):
            flat.update(config_keys(value, key + ".", json_mode))
        else:
            flat[key] = _jsonable(value) if json_mode else value
    return flat


# ---------------------------------------------------------------------------------------------
# Describing a config: what ``describe_recipe`` shows an agent
# ---------------------------------------------------------------------------------------------


def type_text(annotation: Any) -> str:
    """A field's type as a reader writes it: ``int``, ``float | None``, ``list[str]``,
    ``Literal['stdlib', 'files']``."""
    if isinstance(annotation, type) and not get_args(annotation):
        return "None" if annotation is type(None) else annotation.__name__
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Literal:
        return f"Literal[{', '.join(repr(a) for a in args)}]"
    if origin in (Union, UnionType):
        return " | ".join(type_text(a) for a in args)
    if origin is not None and args:
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join(type_text(a) for a in args)}]"
    return str(annotation).replace("typing.", "")


def describe_fields(config: BaseModel, defaults: BaseModel | None = None, prefix: str = "") -> list[dict[str, Any]]:
    """Every leaf key of a config: ``{key, type, default, value, description}``, in field order,
    but for the fields a section leaves out as things stand (:meth:`Section.undescribed`).

    ``value`` is what ``config`` holds (code defaults ← config.yaml ← overrides); ``default`` is
    the code default, taken from ``type(config)()`` so that a recipe whose section instance
    changes a default (``data: MyData = MyData(seq_len=512)``) shows the one that applies.
    """
    if defaults is None:
        try:
            defaults = type(config)()
        except ValidationError:  # a key without a code default
            defaults = None
    described: list[dict[str, Any]] = []
    built = pretrained_model_keys(config) if not prefix else {}
    left_out = config.undescribed() if isinstance(config, Section) else set()
    for name, field in type(config).model_fields.items():
        if name in left_out:
            continue
        key = f"{prefix}{name}"
        value = getattr(config, name)
        default = getattr(defaults, name) if defaults is not None else field.get_default(call_default_factory=True)
        if isinstance(value, BaseModel):
            nested_defaults = default if isinstance(default, type(value)) else None
            described.extend(describe_fields(value, nested_defaults, key + "."))
            continue
        described.append({
            "key": key,
            "type": type_text(field.annotation),
            "default": _as_json(field, default),
            "value": _as_json(field, value),
            "description": field.description or "",
        })
    for item in described:  # a pretrained model's keys: its value, the recipe's marked unused
        if item["key"] in built:
            item["description"] = (
                f"unused: model.pretrained_path is set, so the model's config.json gives {built[item['key']]!r} "
                f"(the recipe's {item['value']!r} is not applied). {item['description']}"
            ).strip()
            item["value"] = built[item["key"]]
    return described


def _as_json(field: Any, value: Any) -> Any:
    """``value`` as JSON, the way ``model_dump(mode="json")`` would write it."""
    from pydantic import TypeAdapter

    try:
        return TypeAdapter(field.annotation).dump_python(value, mode="json")
    except Exception:  # noqa: BLE001 — a recipe's exotic type: show its text
        return str(value)
