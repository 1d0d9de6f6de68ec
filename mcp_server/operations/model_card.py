"""The model card (``README.md``) of a model pushed to the Hub, written from what the server
knows: its own record of the run (base model and the commit the Hub gave, the resolved config,
the data's fingerprint and counts, the code's commit), the skills the commit's trailers name,
and the evaluation run on the pushed checkpoint, with what its numbers are over.

The front matter is the Hub's model card metadata (``base_model``, ``library_name``, ``tags``).
Every value the run's code could have influenced is bounded, and the whole card is redacted.
"""

from __future__ import annotations

import json

import yaml

from engine import run_dir as rd
from mcp_server.models import EvaluateResult
from sandbox.redact import redact

MAX_CONFIG_CHARS = 6000
MAX_VALUE_CHARS = 200


def model_card(record: rd.RunRecord, step: int, skills: list[str], library: str, parameters: int,
               evaluation: EvaluateResult | None, not_evaluated: str | None = None) -> str:
    """The card's text: YAML front matter, then what trained the model. ``library``:
    transformers, peft (an adapter) or gguf."""
    base = next((m for m in record.hub_models if m.repo_type == "model"), None)
    dataset = next((m for m in record.hub_models if m.repo_type == "dataset"), None)
    adapter = library == "peft"
    front: dict[str, object] = {}
    if base is not None:
        front["base_model"] = base.repo_id
    front["library_name"] = library
    front["tags"] = ["trainwright", *dict.fromkeys(_skill_name(s) for s in skills)]
    if dataset is not None:
        front["datasets"] = [dataset.repo_id]
    lines = ["---", yaml.safe_dump(front, sort_keys=False).rstrip(), "---", "",
             f"# {_short(record.recipe) or record.id}", "",
             f"Trained with trainwright: run `{record.id}`, checkpoint at step {step}"
             f" ({parameters:,} parameters{', a peft adapter' if adapter else ''}).", ""]
    lines += ["## Base model", ""]
    if base is not None:
        lines.append(f"- `{base.repo_id}` at revision `{_short(base.revision)}`, commit `{base.commit}`")
    else:
        model = (record.config or {}).get("model", {})
        path = model.get("pretrained_path") if isinstance(model, dict) else None
        lines.append(f"- `{_short(path)}` (a folder of the workspace)" if path else "- none: trained from scratch")
    lines += ["", "## Data", ""]
    lines += _data_lines(record.data, dataset)
    lines += ["", "## Code", ""]
    lines.append(f"- {'script' if record.kind == rd.SCRIPT else 'recipe'} `{_short(record.recipe)}` at commit "
                 f"`{record.git_commit or 'unknown (not a git repository)'}`"
                 + (" with uncommitted changes" if record.recipe_dirty else ""))
    lines.append(f"- skills applied: {', '.join(f'`{_short(s)}`' for s in skills) or 'none'}")
    if record.resumed_from is not None:
        lines.append(f"- resumed from run `{record.resumed_from.run_id}` at step {record.resumed_from.step}")
    lines += ["", "## Evaluation", ""]
    lines += _evaluation_lines(evaluation, not_evaluated)
    config = json.dumps(record.config or {}, indent=1, sort_keys=True, default=str)
    if len(config) > MAX_CONFIG_CHARS:
        config = config[:MAX_CONFIG_CHARS] + "\n… (cut)"
    lines += ["", "## Config", "", "The resolved config (code defaults ← config.yaml ← overrides):", "",
              "```json", config, "```", ""]
    return redact("\n".join(lines))


def _skill_name(applied: str) -> str:
    return applied.split("@")[0][:MAX_VALUE_CHARS]


def _short(value: object) -> str:
    text = "" if value is None else str(value).replace("`", "'").replace("\n", " ")
    return text if len(text) <= MAX_VALUE_CHARS else text[: MAX_VALUE_CHARS - 1] + "…"


def _data_lines(data: rd.DataSummary | None, dataset: rd.HubModel | None) -> list[str]:
    if data is None:
        return ["- not counted (the run reported no data summary)"]
    lines = []
    if dataset is not None:
        lines.append(f"- Hub data set `{dataset.repo_id}`, commit `{dataset.commit}`")
    lines.append(f"- source `{_short(data.source)}`"
                 + (f": {', '.join(f'`{_short(p)}`' for p in data.paths[:10])}" if data.paths else ""))
    lines.append(f"- fingerprint (SHA-256 of the files' paths and bytes): `{data.fingerprint or 'none: generated data'}`")
    if data.streaming:
        size = ", ".join(part for part in (f"{data.files:,} files" if data.files is not None else None,
                                           f"{data.bytes:,} bytes" if data.bytes is not None else None) if part)
        lines.append(f"- streamed{': ' + size if size else ''} (records and tokens were not counted ahead)")
    else:
        lines.append(f"- {data.documents:,} examples, {data.tokens:,} tokens; train {data.train_documents:,} examples, "
                     f"{data.train_tokens:,} tokens; held out {data.eval_documents:,} examples, {data.eval_tokens:,} tokens")
    if data.loss_tokens is not None:
        lines.append(f"- the loss is over {data.loss_tokens:,} tokens ({_short(data.mask)})")
    return lines


def _evaluation_lines(evaluation: EvaluateResult | None, not_evaluated: str | None) -> list[str]:
    if evaluation is None:
        return [f"- not evaluated: {_short(not_evaluated) or 'no evaluation'}"]
    lines = [f"- eval loss {evaluation.eval_loss} (perplexity {evaluation.perplexity}) on the "
             f"{'held-out split' if evaluation.split == 'held_out' else 'data given'}: {evaluation.examples} examples, "
             f"{evaluation.tokens} tokens, {evaluation.loss_tokens} loss tokens, {evaluation.scored_tokens} scored"]
    for name, value in list(evaluation.metrics.items())[:20]:
        lines.append(f"- {_short(name)}: {_short(value)}")
    lines += [f"- note: {_short(w)}" for w in evaluation.warnings]
    return lines
