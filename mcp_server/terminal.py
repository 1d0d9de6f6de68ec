"""How a tool's result reads in a terminal: one function per tool, from its result model to the
text ``trainwright COMMAND`` prints (``--json`` prints the model itself). Pure functions of the
result; :mod:`mcp_server.cli` chooses and prints them."""

from __future__ import annotations

import json
from typing import Any, Callable

from engine.run_dir import DataSummary

# ---------------------------------------------------------------------------------------------
# Skills and recipes
# ---------------------------------------------------------------------------------------------


def skills_text(r) -> str:
    return "\n".join(f"{s.name:<24} {s.version:<7} {'GPU ' if s.requires_gpu else ''}{s.description.split('. ')[0]}"
                     for s in r.skills)


def skill_text(r) -> str:
    return r.skill_md


def apply_text(r) -> str:
    if r.already_applied:
        return f"{r.skill} is already applied to {r.recipe}: nothing to do"
    head = "would change" if r.dry_run else "changed"
    commit = f" (commit {r.commit[:10]})" if r.commit else ""
    acts_on = f"\nacts on: {r.acts_on}" if r.acts_on else ""
    return f"{r.diff}\n{r.skill}@{r.version} {head} {r.recipe}{commit}{acts_on}"


def templates_text(r) -> str:
    return "\n".join(f"{t.name:<16} {t.description}" for t in r.templates)


def scaffold_text(r) -> str:
    return "\n".join([f"created {r.path} (commit {r.commit[:10]})"] + [
        f"applied {s.skill}" + (f" (commit {s.commit[:10]})" if s.commit else " (already there)") for s in r.skills])


def recipes_text(r) -> str:
    if not r.recipes:
        return "no recipes yet; `trainwright scaffold TEMPLATE NAME` creates one"
    lines = [f"{'recipe':<32} {'template':<12} {'skills':>6} {'runs':>5}  last commit"]
    for x in r.recipes:
        last = f"{x.last_commit[:10]} {x.last_change}" if x.last_commit else "(not committed)"
        lines.append(f"{x.path:<32} {x.template or '-':<12} {x.skills:>6} {x.runs:>5}  {last[:80]}")
    if r.truncated:
        lines.append("(more recipes were left out)")
    return "\n".join(lines)


def _value(value: Any) -> str:
    return json.dumps(value) if not isinstance(value, str) else value


def describe_text(r) -> str:
    lines = [f"recipe {r.recipe}" + (f" (from template {r.template})" if r.template else "")]
    for skill in r.skills:
        lines.append(f"  skill  {skill.skill} {skill.params or ''} (commit {skill.commit[:10]})")
    lines.append(f"{'key':<32} {'type':<24} {'value':<16} default  description")
    for f in r.fields:
        value = _value(f.value) + (" *" if f.value != f.default else "")
        lines.append(f"{f.key:<32} {f.type[:24]:<24} {value[:16]:<16} {_value(f.default)[:8]:<8} {f.description}")
    lines.append("* differs from the code default" + (f"; cut to fit: {r.cut}" if r.cut else ""))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Runs
# ---------------------------------------------------------------------------------------------


def launch_text(r) -> str:
    lines = [f"started run {r.run_id} → {r.run_dir}", f"  code   {r.code}"]
    if r.data:
        lines.append(f"  {DataSummary.model_validate(r.data).describe()}")
    if r.config_changes:
        lines.append("  config " + ", ".join(f"{k}={json.dumps(v)}" for k, v in r.config_changes.items()))
    lines.extend(f"  warning {w}" for w in r.warnings)
    return "\n".join(lines)


def job_text(r) -> str:
    lines = [f"run {r.run_id} → {r.run_dir}: {r.nodes}"]
    lines.extend(f"  warning {w}" for w in r.warnings)
    if r.status != "stopped":  # submitted
        lines.append(f"  `trainwright status {r.run_id}` follows the job (squeue/sacct); `trainwright stop` cancels it")
    return "\n".join(lines)


def runs_text(r) -> str:
    if not r.runs:
        return "no runs yet; `trainwright run RECIPE` starts one"
    lines = [f"{'run id':<40} {'status':<10} {'step':>11} {'loss':>8} {'mean tok/s':>10}  recipe"]
    for s in r.runs:
        step = f"{s.step or 0}/{s.max_steps or '?'}"
        loss = f"{s.loss:.4f}" if isinstance(s.loss, float) else "-"
        speed = f"{s.mean_tokens_per_s:,.0f}" if isinstance(s.mean_tokens_per_s, float) else "-"
        lines.append(f"{s.run_id:<40} {s.status:<10} {step:>11} {loss:>8} {speed:>10}  {s.recipe}")
    lines.append("mean tok/s: tokens read per second (padding left out) over the steps after the warm-up (the first logging window)")
    return "\n".join(lines)


def status_text(r) -> str:
    lines = [f"run {r.run_id}: {r.status}", f"  recipe     {r.recipe}", f"  code       {r.code}",
             f"  processes  {r.world_size or r.nproc}"]
    rows: list[tuple[str, Any]] = [
        ("nodes      ", r.nodes),
        ("", DataSummary.model_validate(r.data).describe() if r.data else None),
        ("config     ", ", ".join(f"{k}={json.dumps(v)}" for k, v in r.config_changes.items())),
        ("isolation  ", f"{r.isolation} ({r.isolation_note})" if r.isolation else None),
        ("step       ", f"{r.step}/{r.max_steps if r.max_steps is not None else '?'}" if r.step is not None else None),
        ("latest     ", format_record(r.latest) if r.latest else None),
        ("speed      ", r.speed),
        ("eta        ", f"{r.eta_s:.0f} s" if r.eta_s is not None else None),
        ("checkpoints steps ", ", ".join(str(c.step) for c in r.checkpoints)),
    ]
    lines += [f"  {label}{value}" for label, value in rows if value]
    lines += [f"  metrics    {destination}" for destination in r.metrics_destinations]
    lines += [f"  {label}{value}" for label, value in (("network    ", r.network_note), ("error      ", r.error))
              if value]
    lines += [f"  warning    {warning}" for warning in r.warnings]
    if r.console_tail:
        lines.append("  console.log (end):")
        lines.extend("    " + line for line in r.console_tail.splitlines()[-20:])
    return "\n".join(lines)


def format_record(record: dict[str, Any]) -> str:
    # The record's rates are its logging window's: named so (the run's mean is get_run's speed).
    keys = {"loss": "loss", "eval_loss": "eval_loss", "lr": "lr", "grad_norm": "grad_norm",
            "tokens_per_s": "window tokens_per_s", "step_time_s": "window step_time_s"}
    parts = [f"step {record.get('step')}"]
    for key, label in keys.items():
        value = record.get(key)
        if isinstance(value, float):
            parts.append(f"{label} {value:.4g}")
    return " | ".join(parts)


def wait_text(r) -> str:
    where = f"step {r.step if r.step is not None else '-'}/{r.max_steps or '?'}"
    line = {"reached_step": f"run {r.run_id} reached {where} ({r.status})",
            "ended": f"run {r.run_id} ended: {r.status} at {where}",
            "timeout": f"run {r.run_id} still {r.status} at {where} after {r.waited_s:.0f} s"}[r.reason]
    return line + (f"\n  error      {r.error}" if r.error else "")


def estimate_text(r) -> str:
    e = r.estimate
    memory = ", ".join(f"{k} {v:.3g}" for k, v in e["memory_gib"].items() if k != "peak_gib")
    fits = "" if r.fits is None else ("; fits" if r.fits else "; does NOT fit")
    lines = [f"{e['recipe']} on {e['nproc']} × {e['device']}, per process:",
             f"  parameters  {e['params']:,} ({e['trainable']:,} trainable); checkpointed blocks {e['checkpointed_blocks']}",
             f"  peak memory {e['memory_gib']['peak_gib']:.3g} GiB ({memory}){fits}",
             f"  activations {e['activations_source']}"]
    if e["step_time_s"] is not None:
        lines.append(f"  step time   {e['step_time_s']:.3g} s ({e['flops_per_token']:,.0f} FLOPs/token; {e['time_source']})")
    lines += [f"  change      {c['change']}: {c['peak_gib']:.3g} GiB{'' if c['fits'] else ' (does not fit)'}"
              for c in r.changes]
    return "\n".join(lines)


def compare_text(r) -> str:
    lines = [f"b {r.run_b} against a {r.run_a}"]
    lines += [f"  differs  {d}" for d in r.differences] or ["  differs  nothing in config or code"]
    lines += [f"  {m.metric:<12} {m.verdict:<13}{metric_line(m, numbers_only=True)}: {m.evidence}" for m in r.metrics]
    lines += [f"  left out {why}" for why in r.left_out]
    return "\n".join(lines)


def ab_text(r) -> str:
    sides = f"a = {r.commit_a[:10]} (before it), b = {r.commit_b[:10]} (its commit)" if r.skill else \
        f"a = {r.commit_a[:10]}, b = {r.commit_b[:10]}"
    from mcp_server.operations.ab import run_length

    lines = [f"A/B of {r.skill or 'two commits'} on {r.recipe}: {sides}, {r.rounds} round(s) of "
             f"{run_length(r.steps, r.args)}",
             "  order    " + " ".join(f"{run.side}:{run.run_id}" for run in r.runs)]
    for rnd in r.per_round:
        lines.append(f"  round {rnd.round}  " + "; ".join(metric_line(m) for m in rnd.metrics))
    if r.verdict:
        lines.append(f"verdict, b against a over {len(r.per_round)} round(s):")
        lines += [f"  {m.metric:<12} {m.verdict:<13}{metric_line(m, numbers_only=True)}: {m.evidence}" for m in r.verdict]
    lines += [f"  differs  {d}" for d in r.differences]
    lines += [f"  left out {why}" for why in r.left_out]
    lines += [f"  remark   {remark}" for remark in r.remarks]
    if r.error:
        lines.append(f"  error    {r.error}")
    if r.note_written:
        lines.append(f"the verdict is in the note of {r.commit_b[:10]}: git log --notes=trainwright -1 {r.commit_b[:10]}")
    return "\n".join(lines)


def metric_line(m, numbers_only: bool = False) -> str:
    numbers = f" {m.a:,.6g} → {m.b:,.6g}" if m.a is not None and m.b is not None else ""
    ratio = f" (×{m.ratio:.3g})" if m.ratio is not None else ""
    return numbers + ratio if numbers_only else f"{m.metric} {m.verdict}{numbers}{ratio}"


def stop_text(r) -> str:
    return f"run {r.run_id}: {r.status}"


def data_cache_text(r) -> str:
    lines = [f"removed {name} ({size / 1e6:.1f} MB)" for name, size in r.removed.items()]
    lines += [f"{size / 1e6:>10.1f} MB  {name}" for name, size in r.stores.items()] or [f"no tokenized data in {r.folder}"]
    if r.not_listed:
        lines.append(f"… {r.not_listed} smaller store(s) not listed")
    lines.append(f"{r.total_bytes / 1e6:.1f} MB in {r.folder}")
    lines += [f"{size / 1e6:>10.1f} MB  {name}" for name, size in r.start_models.items()]
    return "\n".join(lines)


def checkpoints_text(r) -> str:
    listed = ("\n".join(f"step {c.step:>8}  {c.path}" for c in r.checkpoints)
              or f"run {r.run_id} has no complete checkpoint yet")
    return "\n".join([listed, *(f"not complete: {why}" for why in r.unusable)])


# ---------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------


def export_text(r) -> str:
    lines = [f"exported run {r.run_id} step {r.step} → {r.path} ({r.parameters:,} parameters"
             + (f", LoRA {r.lora}" if r.lora else "") + ")"]
    lines += [f"  {size:>12,}  {name}" for name, size in r.files.items()]
    return "\n".join(lines)


def sample_text(r) -> str:
    lines = []
    for item in r.samples:
        lines.append(f"--- {item.prompt!r} ({item.new_tokens} tokens, stopped at {item.stopped})")
        if item.input is not None:
            lines.append(f"    with {item.input}")
        if "reasoning" in item.raw:
            lines.append(f"    reasoning: {item.raw['reasoning']}")
        lines.append(item.prompt + item.completion)
        for call in item.raw.get("tool_calls", []):
            lines.append(f"    tool call: {call.get('name')}({json.dumps(call.get('arguments'))})")
        if item.expected is not None:
            lines.append(f"    expected: {item.expected}")
    return "\n".join(lines)


def evaluate_text(r) -> str:
    if r.split == "tasks":  # lm-eval's scores, a line per task
        lines = [f"run {r.run_id} step {r.step}: lm-eval"]
        for task, score in r.tasks.items():  # engine.seams.TaskScore's fields
            stderr = score["stderr"]
            values = [f"{k} {v:.4g}" + (f" ± {stderr[k]:.2g}" if k in stderr else "") for k, v in score["metrics"].items()]
            counted = f" ({score['examples']:,} examples)" if score["examples"] is not None else ""
            lines.append(f"  {task}{counted}: " + (", ".join(values) or "no metric"))
        return "\n".join(lines + [f"warning: {w}" for w in r.warnings])
    loss = f"{r.eval_loss:.4f}" if r.eval_loss is not None else "not finite"
    split = "held-out split" if r.split == "held_out" else "data given"
    size = (f"{r.examples:,} example(s) of the {split}" if r.examples is not None else f"the {split}")
    if r.tokens is not None:
        size += f", {r.tokens:,} tokens ({r.loss_tokens if r.loss_tokens is not None else r.tokens:,} loss tokens)"
    parts = [f"run {r.run_id} step {r.step}: eval_loss {loss} over {size}"]
    parts += [f"{key} {value:.4g}" for key, value in r.metrics.items()]
    return " | ".join(parts) + "".join(f"\nwarning: {w}" for w in r.warnings)


# The tools whose command only prints its result; run, resume, tail and wait do more
# (mcp_server.cli.AFTER) with launch_text, format_record and wait_text.
TEXT: dict[str, Callable[[Any], str]] = {
    "list_skills": skills_text, "get_skill": skill_text, "apply_skill": apply_text,
    "list_templates": templates_text, "scaffold_recipe": scaffold_text, "describe_recipe": describe_text,
    "list_recipes": recipes_text, "estimate_run": estimate_text, "list_runs": runs_text,
    "get_run": status_text, "compare_runs": compare_text, "stop_run": stop_text,
    "list_checkpoints": checkpoints_text, "data_cache": data_cache_text, "export_checkpoint": export_text, "sample": sample_text,
    "evaluate": evaluate_text,
}
