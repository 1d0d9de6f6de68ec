"""The ``trainwright`` command line: the CLI twin of every MCP tool, for people and CI agents.

Every command takes ``--workspace DIR`` (default: the current directory) and ``--json`` (one
JSON object on stdout, the same object the MCP tool returns). Exit codes:

    0  success            2  bad input or refused (the message says what to change)
    1  the run failed     3  not found (unknown run, recipe, checkpoint, skill, template)
   70  internal error   124  wait: the timeout passed first
  130  stopped or interrupted
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

from pydantic import BaseModel

from engine.run_dir import DataSummary
from engine.errors import EXIT_INTERNAL, EXIT_OK, EXIT_STOPPED, EXIT_TIMEOUT, BadInput, TrainwrightError
from engine.errors import EXIT_RUN_FAILED as EXIT_FAILED

EPILOG = """exit codes: 0 success, 1 the run failed, 2 bad input or refused, 3 not found,
70 internal error (a bug), 124 (wait) the timeout passed first, 130 stopped or interrupted.
Every command accepts --workspace DIR and --json."""


def _workspace(args: argparse.Namespace):
    from sandbox.workspace import Workspace

    return Workspace.open(args.workspace, getattr(args, "settings", None))


class _DownloadBar:
    """A Hub model's download as a progress bar on stderr (tqdm, which huggingface_hub brings)."""

    def __init__(self) -> None:
        self.bar: Any = None

    def __call__(self, done: float, total: float | None, message: str) -> None:
        from tqdm import tqdm

        if self.bar is None:
            self.bar = tqdm(total=total, unit="B", unit_scale=True, file=sys.stderr, desc=message.split(":")[0],
                            leave=True)
        self.bar.update(max(0.0, done - self.bar.n))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _emit(args: argparse.Namespace, result: BaseModel, text: Callable[[Any], str]) -> None:
    if args.json:
        print(result.model_dump_json())
    else:
        print(text(result))


# ---------------------------------------------------------------------------------------------
# Runs
# ---------------------------------------------------------------------------------------------


def cmd_run(args: argparse.Namespace) -> int:
    from mcp_server.operations import runs

    ws = _workspace(args)
    rdzv = {key: value for key, value in (("endpoint", args.rdzv_endpoint), ("id", args.rdzv_id),
                                          ("node_rank", args.node_rank)) if value is not None}
    slurm = {key: value for key, value in (("partition", args.partition), ("time", args.time),
                                           ("gpus_per_node", args.gpus_per_node), ("rdzv_port", args.rdzv_port))
             if value is not None}
    bar = _DownloadBar()
    try:
        result = runs.launch_run(ws, args.recipe, nproc=args.nproc, overrides=args.overrides, nnodes=args.nnodes,
                                 rdzv=rdzv or None, target=args.target, slurm=slurm or None, progress=bar,
                                 args=getattr(args, "script_args", None) or None, resume_arg=args.resume_arg)
    finally:
        bar.close()
    if args.target == "slurm":  # the job runs on the cluster: `status` follows it
        _emit(args, result, _job_text)
        return EXIT_OK
    return _after_launch(args, ws, result)


def _job_text(r) -> str:
    lines = [f"run {r.run_id} → {r.run_dir}: {r.nodes}"]
    lines.extend(f"  warning {w}" for w in r.warnings)
    if r.status != "stopped":  # submitted
        lines.append(f"  `trainwright status {r.run_id}` follows the job (squeue/sacct); `trainwright stop` cancels it")
    return "\n".join(lines)


def cmd_resume(args: argparse.Namespace) -> int:
    from mcp_server.operations import runs

    ws = _workspace(args)
    bar = _DownloadBar()
    try:
        result = runs.resume_checkpoint(
            ws, args.run_id, step=args.step, nproc=args.nproc, overrides=args.overrides, code=args.code, progress=bar
        )
    finally:
        bar.close()
    return _after_launch(args, ws, result)


def _after_launch(args, ws, result) -> int:
    """Detached: print the handle. Foreground: stream the console, then print the outcome."""
    if args.detach:
        _emit(args, result, lambda r: _launch_text(r) + f"\n`trainwright status {r.run_id}` shows how it goes")
        return EXIT_OK
    if not args.json:
        print(_launch_text(result), flush=True)
    code = _follow_run(ws, result.run_id, echo=not args.json)
    if args.json:
        from mcp_server.operations import runs

        final = result.model_copy(update={"status": runs.get_run(ws, result.run_id).status})
        print(final.model_dump_json())
    return code


def _launch_text(r) -> str:
    lines = [f"started run {r.run_id} → {r.run_dir}", f"  code   {r.code}"]
    if r.data:
        lines.append(f"  {DataSummary.model_validate(r.data).describe()}")
    if r.config_changes:
        lines.append("  config " + ", ".join(f"{k}={json.dumps(v)}" for k, v in r.config_changes.items()))
    lines.extend(f"  warning {w}" for w in r.warnings)
    return "\n".join(lines)


def _follow_run(ws, run_id: str, echo: bool) -> int:
    """Print the run's console output until it ends; Ctrl-C stops the run."""
    from engine import run_dir as rd
    from mcp_server.operations import runs

    run_dir = ws.run_dir(run_id)
    console = run_dir / rd.CONSOLE_LOG
    offset = 0
    stopping = False
    while True:
        try:
            _, record = runs.run_view(ws, run_id)
            ended = record.effective_status() in rd.FINAL_STATUSES and not record.supervisor_alive()
            chunk = b""
            f = rd.open_run_output(console)  # not through a link the run left
            if f is not None:
                with f:
                    f.seek(offset)
                    chunk = f.read()
            if not ended:  # whole lines only, so that redaction sees every line whole
                chunk = chunk[: chunk.rfind(b"\n") + 1]
            offset += len(chunk)
            if chunk and echo:
                sys.stdout.write(chunk.decode("utf-8", errors="replace"))
                sys.stdout.flush()
            if ended:
                break
            time.sleep(0.3)
        except KeyboardInterrupt:
            if stopping:
                raise
            stopping = True
            print("\nstopping the run (Ctrl-C again to leave it running in the background)…", file=sys.stderr)
            runs.stop_run(ws, run_id)
    info = runs.get_run(ws, run_id)
    return {rd.COMPLETED: EXIT_OK, rd.STOPPED: EXIT_STOPPED}.get(info.status, EXIT_FAILED)


def cmd_runs(args: argparse.Namespace) -> int:
    from mcp_server.operations import runs

    result = runs.list_runs(_workspace(args), limit=args.limit)

    def text(r) -> str:
        if not r.runs:
            return "no runs yet; `trainwright run RECIPE` starts one"
        lines = [f"{'run id':<40} {'status':<10} {'step':>11} {'loss':>8} {'mean tok/s':>10}  recipe"]
        for s in r.runs:
            step = f"{s.step or 0}/{s.max_steps or '?'}"
            loss = f"{s.loss:.4f}" if isinstance(s.loss, float) else "-"
            speed = f"{s.mean_tokens_per_s:,.0f}" if isinstance(s.mean_tokens_per_s, float) else "-"
            lines.append(f"{s.run_id:<40} {s.status:<10} {step:>11} {loss:>8} {speed:>10}  {s.recipe}")
        lines.append("mean tok/s: supervised tokens/s over the steps after the warm-up (the first logging window)")
        return "\n".join(lines)

    _emit(args, result, text)
    return EXIT_OK


def cmd_status(args: argparse.Namespace) -> int:
    from mcp_server.operations import runs

    result = runs.get_run(_workspace(args), args.run_id)

    def text(r) -> str:
        lines = [f"run {r.run_id}: {r.status}", f"  recipe     {r.recipe}", f"  code       {r.code}"]
        lines.append(f"  processes  {r.world_size or r.nproc}")
        if r.nodes:
            lines.append(f"  nodes      {r.nodes}")
        if r.data:
            lines.append(f"  {DataSummary.model_validate(r.data).describe()}")
        if r.config_changes:
            lines.append("  config     " + ", ".join(f"{k}={json.dumps(v)}" for k, v in r.config_changes.items()))
        if r.isolation:
            lines.append(f"  isolation  {r.isolation} ({r.isolation_note})")
        if r.step is not None:
            lines.append(f"  step       {r.step}/{r.max_steps if r.max_steps is not None else '?'}")
        if r.latest:
            lines.append(f"  latest     {_format_record(r.latest)}")
        if r.speed:
            lines.append(f"  speed      {r.speed}")
        if r.eta_s is not None:
            lines.append(f"  eta        {r.eta_s:.0f} s")
        if r.checkpoints:
            lines.append(f"  checkpoints steps {', '.join(str(c.step) for c in r.checkpoints)}")
        lines.extend(f"  metrics    {destination}" for destination in r.metrics_destinations)
        if r.network_note:
            lines.append(f"  network    {r.network_note}")
        if r.error:
            lines.append(f"  error      {r.error}")
        for warning in r.warnings:
            lines.append(f"  warning    {warning}")
        if r.console_tail:
            lines.append("  console.log (end):")
            lines.extend("    " + line for line in r.console_tail.splitlines()[-20:])
        return "\n".join(lines)

    _emit(args, result, text)
    return EXIT_OK


def _format_record(record: dict[str, Any]) -> str:
    # The record's rates are its logging window's: named so (the run's mean is get_run's speed).
    keys = {"loss": "loss", "eval_loss": "eval_loss", "lr": "lr", "grad_norm": "grad_norm",
            "tokens_per_s": "window tokens_per_s", "step_time_s": "window step_time_s"}
    parts = [f"step {record.get('step')}"]
    for key, label in keys.items():
        value = record.get(key)
        if isinstance(value, float):
            parts.append(f"{label} {value:.4g}")
    return " | ".join(parts)


def cmd_tail(args: argparse.Namespace) -> int:
    from engine import run_dir as rd
    from mcp_server.limits import MAX_TAIL_RECORDS
    from mcp_server.operations import runs

    ws = _workspace(args)
    result = runs.tail_metrics(ws, args.run_id, n=args.n, after_step=args.after_step,
                               follow_resumes=args.follow_resumes)
    if not args.json:
        for point in result.resumes:
            print(f"(steps after {point.step}: run {point.run_id})", flush=True)
    if args.json and not args.follow:
        print(result.model_dump_json())
        return EXIT_OK
    last_step = args.after_step
    for record in result.records:
        print(json.dumps(record) if args.json else _format_record(record), flush=True)
        last_step = record.get("step", last_step)
    while args.follow:
        time.sleep(1.0)
        more = runs.tail_metrics(ws, args.run_id, n=MAX_TAIL_RECORDS, after_step=last_step)
        for record in more.records:
            print(json.dumps(record) if args.json else _format_record(record), flush=True)
            last_step = record.get("step", last_step)
        if more.status in rd.FINAL_STATUSES:
            break
    return EXIT_OK


def cmd_wait(args: argparse.Namespace) -> int:
    """Wait for a step or the end of a run; each new step is a line on stderr (unless --json)."""
    import anyio

    from engine import run_dir as rd
    from mcp_server.operations import waiting

    ws = _workspace(args)

    async def progress(now: waiting.Observation) -> None:
        if not args.json:
            print(now.progress_message(), file=sys.stderr, flush=True)

    result = anyio.run(lambda: waiting.wait_run(ws, args.run_id, args.until_step, args.timeout, progress))

    def text(r) -> str:
        where = f"step {r.step if r.step is not None else '-'}/{r.max_steps or '?'}"
        line = {"reached_step": f"run {r.run_id} reached {where} ({r.status})",
                "ended": f"run {r.run_id} ended: {r.status} at {where}",
                "timeout": f"run {r.run_id} still {r.status} at {where} after {r.waited_s:.0f} s"}[r.reason]
        return line + (f"\n  error      {r.error}" if r.error else "")

    _emit(args, result, text)
    if result.reason == "timeout":
        return EXIT_TIMEOUT
    if result.reason == "ended":
        outcomes: dict[str, int] = {rd.COMPLETED: EXIT_OK, rd.STOPPED: EXIT_STOPPED}
        return outcomes.get(result.status, EXIT_FAILED)
    return EXIT_OK


def cmd_estimate(args: argparse.Namespace) -> int:
    from mcp_server.operations import estimate

    result = estimate.estimate_run(_workspace(args), args.recipe, args.overrides, args.nproc, args.device,
                                   args.device_memory_gib)
    _emit(args, result, _estimate_text)
    return EXIT_OK


def _estimate_text(r) -> str:
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


def cmd_compare(args: argparse.Namespace) -> int:
    from mcp_server.operations import compare

    result = compare.compare_runs(_workspace(args), args.run_a, args.run_b)
    _emit(args, result, _compare_text)
    return EXIT_OK


def _compare_text(r) -> str:
    lines = [f"b {r.run_b} against a {r.run_a}"]
    lines += [f"  differs  {d}" for d in r.differences] or ["  differs  nothing in config or code"]
    for m in r.metrics:
        numbers = f" {m.a:,.6g} → {m.b:,.6g}" if m.a is not None and m.b is not None else ""
        ratio = f" (×{m.ratio:.3g})" if m.ratio is not None else ""
        lines.append(f"  {m.metric:<12} {m.verdict:<13}{numbers}{ratio}: {m.evidence}")
    lines += [f"  left out {why}" for why in r.left_out]
    return "\n".join(lines)


def cmd_stop(args: argparse.Namespace) -> int:
    from mcp_server.operations import runs

    result = runs.stop_run(_workspace(args), args.run_id)
    _emit(args, result, lambda r: f"run {r.run_id}: {r.status}")
    return EXIT_OK


def cmd_checkpoints(args: argparse.Namespace) -> int:
    from mcp_server.operations import runs

    result = runs.list_checkpoints(_workspace(args), args.run_id)
    _emit(
        args,
        result,
        lambda r: "\n".join(f"step {c.step:>8}  {c.path}" for c in r.checkpoints)
        or f"run {r.run_id} has no complete checkpoint yet",
    )
    return EXIT_OK


# ---------------------------------------------------------------------------------------------
# Models: export, sample, evaluate
# ---------------------------------------------------------------------------------------------


def cmd_export(args: argparse.Namespace) -> int:
    from mcp_server.operations import model_tools

    if not args.json:
        print(f"exporting run {args.run_id} in the sandbox…", file=sys.stderr, flush=True)
    result = model_tools.export_checkpoint(_workspace(args), args.run_id, args.to, args.step, args.lora)

    def text(r) -> str:
        lines = [f"exported run {r.run_id} step {r.step} → {r.path} ({r.parameters:,} parameters"
                 + (f", LoRA {r.lora}" if r.lora else "") + ")"]
        lines += [f"  {size:>12,}  {name}" for name, size in r.files.items()]
        return "\n".join(lines)

    _emit(args, result, text)
    return EXIT_OK


def cmd_sample(args: argparse.Namespace) -> int:
    from mcp_server.operations import model_tools

    result = model_tools.sample(_workspace(args), args.run_id, args.prompts, args.step,
                                args.max_new_tokens, args.temperature)

    def text(r) -> str:
        lines = []
        for item in r.samples:
            lines.append(f"--- {item.prompt!r} ({item.new_tokens} tokens, stopped at {item.stopped})")
            if item.input is not None:
                lines.append(f"    with {item.input}")
            lines.append(item.prompt + item.completion)
            if item.expected is not None:
                lines.append(f"    expected: {item.expected}")
        return "\n".join(lines)

    _emit(args, result, text)
    return EXIT_OK


def cmd_evaluate(args: argparse.Namespace) -> int:
    from mcp_server.operations import model_tools

    result = model_tools.evaluate(_workspace(args), args.run_id, args.step, args.data)

    def text(r) -> str:
        loss = f"{r.eval_loss:.4f}" if r.eval_loss is not None else "not finite"
        split = "held-out split" if r.split == "held_out" else "data given"
        size = (f"{r.examples:,} example(s) of the {split}" if r.examples is not None else f"the {split}")
        if r.tokens is not None:
            size += f", {r.tokens:,} tokens ({r.loss_tokens if r.loss_tokens is not None else r.tokens:,} loss tokens)"
        parts = [f"run {r.run_id} step {r.step}: eval_loss {loss} over {size}"]
        parts += [f"{key} {value:.4g}" for key, value in r.metrics.items()]
        return " | ".join(parts) + "".join(f"\nwarning: {w}" for w in r.warnings)

    _emit(args, result, text)
    return EXIT_OK


# ---------------------------------------------------------------------------------------------
# Server, skills, recipes, review
# ---------------------------------------------------------------------------------------------


def cmd_serve(args: argparse.Namespace) -> int:
    from mcp_server.server import serve

    if args.no_auth and args.http is None:
        raise BadInput("--no-auth applies to --http only")
    serve(args.workspace, http_port=args.http, read_only=args.read_only, auth=not args.no_auth,
          settings=args.settings)
    return EXIT_OK


def cmd_skills_list(args: argparse.Namespace) -> int:
    from mcp_server.operations import skills

    result = skills.list_skills()
    _emit(args, result, lambda r: "\n".join(
        f"{s.name:<24} {s.version:<7} {'GPU ' if s.requires_gpu else ''}{s.description.split('. ')[0]}"
        for s in r.skills))
    return EXIT_OK


def cmd_skills_show(args: argparse.Namespace) -> int:
    from mcp_server.operations import skills

    result = skills.get_skill(args.name)
    _emit(args, result, lambda r: r.skill_md)
    return EXIT_OK


def cmd_templates(args: argparse.Namespace) -> int:
    from mcp_server.operations import recipes

    result = recipes.list_templates()
    _emit(args, result, lambda r: "\n".join(f"{t.name:<16} {t.description}" for t in r.templates))
    return EXIT_OK


def _key_values(items: list[str]) -> dict[str, Any]:
    """``["a.b=1", "c=[x]"]`` → ``{"a.b": 1, "c": ["x"]}``: the engine's one override reader."""
    from engine.config import overrides_to_dict

    return overrides_to_dict(items)


def cmd_scaffold(args: argparse.Namespace) -> int:
    from mcp_server.operations import recipes

    bar = _DownloadBar()
    try:
        result = recipes.scaffold_recipe(
            _workspace(args), args.template, args.name, _key_values(args.config), args.skill, progress=bar
        )
    finally:
        bar.close()
    _emit(args, result, lambda r: "\n".join(
        [f"created {r.path} (commit {r.commit[:10]})"]
        + [f"applied {s.skill}" + (f" (commit {s.commit[:10]})" if s.commit else " (already there)") for s in r.skills]))
    return EXIT_OK


def cmd_recipes(args: argparse.Namespace) -> int:
    from mcp_server.operations import recipe_info

    result = recipe_info.list_recipes(_workspace(args))

    def text(r) -> str:
        if not r.recipes:
            return "no recipes yet; `trainwright scaffold TEMPLATE NAME` creates one"
        lines = [f"{'recipe':<32} {'template':<12} {'skills':>6} {'runs':>5}  last commit"]
        for x in r.recipes:
            last = f"{x.last_commit[:10]} {x.last_change}" if x.last_commit else "(not committed)"
            lines.append(f"{x.path:<32} {x.template or '-':<12} {x.skills:>6} {x.runs:>5}  {last[:80]}")
        if r.truncated:
            lines.append("(more recipes were left out)")
        return "\n".join(lines)

    _emit(args, result, text)
    return EXIT_OK


def cmd_describe(args: argparse.Namespace) -> int:
    from mcp_server.operations import recipe_info

    result = recipe_info.describe_recipe(_workspace(args), args.recipe)

    def shown(value: Any) -> str:
        return json.dumps(value) if not isinstance(value, str) else value

    def text(r) -> str:
        lines = [f"recipe {r.recipe}" + (f" (from template {r.template})" if r.template else "")]
        for skill in r.skills:
            lines.append(f"  skill  {skill.skill} {skill.params or ''} (commit {skill.commit[:10]})")
        lines.append(f"{'key':<32} {'type':<24} {'value':<16} default  description")
        for f in r.fields:
            value = shown(f.value) + (" *" if f.value != f.default else "")
            lines.append(f"{f.key:<32} {f.type[:24]:<24} {value[:16]:<16} {shown(f.default)[:8]:<8} {f.description}")
        lines.append("* differs from the code default" + ("; descriptions were cut to fit" if r.cut else ""))
        return "\n".join(lines)

    _emit(args, result, text)
    return EXIT_OK


def cmd_apply(args: argparse.Namespace) -> int:
    from mcp_server.operations import skills

    params = skills.with_target(_key_values(args.param), args.target)
    result = skills.apply_skill(_workspace(args), args.skill, args.recipe, params, dry_run=args.dry_run)

    def text(r) -> str:
        if r.already_applied:
            return f"{r.skill} is already applied to {r.recipe}: nothing to do"
        head = "would change" if r.dry_run else "changed"
        commit = f" (commit {r.commit[:10]})" if r.commit else ""
        acts_on = f"\nacts on: {r.acts_on}" if r.acts_on else ""
        return f"{r.diff}\n{r.skill}@{r.version} {head} {r.recipe}{commit}{acts_on}"

    _emit(args, result, text)
    return EXIT_OK


def cmd_review(args: argparse.Namespace) -> int:
    from mcp_server.operations import review

    result = review.review(_workspace(args), args.base)
    _emit(args, result, review.format_review)
    return EXIT_OK


def cmd_audit(args: argparse.Namespace) -> int:
    """The latest entries of ``.trainwright/audit.jsonl``: every tool call, oldest first."""
    from sandbox.audit import AuditLog

    if args.n < 1:
        raise BadInput("-n must be at least 1")
    entries = AuditLog(_workspace(args).state_dir).tail(args.n)
    if args.json:
        print(json.dumps({"entries": entries}))
        return EXIT_OK
    if not entries:
        print("no tool calls recorded yet (.trainwright/audit.jsonl is empty)")
    for entry in entries:
        arguments = json.dumps(entry.get("arguments", {}), separators=(",", ":"))
        outcome = entry.get("outcome", "?")
        line = f"{entry.get('time', '?')}  {entry.get('tool', '?'):<18} {outcome:<5} {arguments[:100]}"
        produced = entry.get("commit", "")[:10] or entry.get("run_id", "")
        if produced:
            line += f"  → {produced}"
        print(line)
        if entry.get("error"):
            print(f"    {str(entry['error']).splitlines()[0][:200]}")
    return EXIT_OK


def cmd_plot(args: argparse.Namespace) -> int:
    from mcp_server.plot import history_png

    ws = _workspace(args)
    output = Path(args.output or f"{args.run_id}-loss.png")
    output.write_bytes(history_png(ws, args.run_id))
    if args.json:
        print(json.dumps({"run_id": args.run_id, "path": str(output)}))
    else:
        print(f"wrote {output}")
    return EXIT_OK


# ---------------------------------------------------------------------------------------------
# Parser
# ---------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    from mcp_server.limits import DEFAULT_TAIL_RECORDS, DEFAULT_WAIT_S, MAX_TAIL_RECORDS, MAX_WAIT_S

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--workspace", default=".", metavar="DIR",
        help="the workspace folder (default: the current directory)",
    )
    common.add_argument("--json", action="store_true", help="print one JSON object")

    parser = argparse.ArgumentParser(
        prog="trainwright",
        description="Train models with skills as reviewable commits, real FSDP2 runs and "
        "resumable checkpoints. Every command is the twin of an MCP tool.",
        epilog=EPILOG,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, func, help: str, **kwargs) -> argparse.ArgumentParser:
        p = sub.add_parser(name, parents=[common], help=help, description=help, epilog=EPILOG, **kwargs)
        p.set_defaults(func=func)
        return p

    def launch_options(p: argparse.ArgumentParser, nproc_default) -> None:
        p.add_argument("--nproc", type=int, default=nproc_default, help="processes (FSDP2 ranks)")
        p.add_argument(
            "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
            help="override a config value, e.g. --set train.max_steps=50 (repeatable)",
        )
        p.add_argument("--detach", action="store_true", help="start it and return at once")
        settings_option(p)

    def settings_option(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--config", dest="settings", metavar="FILE",
            help="trusted settings (runs: limits); default $XDG_CONFIG_HOME/trainwright/config.yaml "
            "(~/.config/trainwright/config.yaml). The workspace's .trainwright/config.yaml may only tighten them",
        )

    p = add("serve", cmd_serve, "serve the MCP tools (stdio by default)")
    p.add_argument("--http", type=int, metavar="PORT",
                   help="serve streamable HTTP on http://127.0.0.1:PORT/mcp; requests need the bearer token "
                   "printed at start (also in $XDG_STATE_HOME/trainwright/http-token, default "
                   "~/.local/state/trainwright/http-token)")
    p.add_argument("--no-auth", action="store_true",
                   help="with --http: accept requests without the token (any local user can then call the tools)")
    p.add_argument("--read-only", action="store_true", help="serve only tools that change nothing")
    settings_option(p)

    skills_parser = sub.add_parser("skills", help="list or show skills (list_skills, get_skill)")
    skills_sub = skills_parser.add_subparsers(dest="skills_command", required=True, metavar="ACTION")
    p = skills_sub.add_parser("list", parents=[common], help="list the skills", epilog=EPILOG)
    p.set_defaults(func=cmd_skills_list)
    p = skills_sub.add_parser("show", parents=[common], help="print a skill's SKILL.md", epilog=EPILOG)
    p.add_argument("name")
    p.set_defaults(func=cmd_skills_show)

    add("templates", cmd_templates, "list recipe templates (list_templates)")

    p = add("scaffold", cmd_scaffold, "create recipes/NAME from a template, as a commit (scaffold_recipe)")
    p.add_argument("template")
    p.add_argument("name")
    p.add_argument("--config", action="append", default=[], metavar="KEY=VALUE",
                   help="config value written to config.yaml, e.g. --config train.max_steps=500")
    p.add_argument("--skill", action="append", default=[], metavar="SKILL",
                   help="apply this skill after scaffolding, as its own commit (repeatable)")

    add("recipes", cmd_recipes, "list the workspace's recipes: template, last commit, skills, runs (list_recipes)")

    p = add("describe", cmd_describe, "every config key of a recipe, its template and skills (describe_recipe)")
    p.add_argument("recipe", help="recipe folder, relative to the workspace, or its name")

    p = add("apply", cmd_apply, "apply a skill to a recipe folder or script, as one commit (apply_skill)")
    p.add_argument("skill")
    p.add_argument("recipe", help="recipe folder or .py script, relative to the workspace")
    p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE", help="skill parameter")
    p.add_argument("--dry-run", action="store_true", help="print the diff; change nothing")
    p.add_argument("--target", metavar="EXPR", help="the model to act on (self._model, file.py:LINE): "
                   "a refusal lists the candidates it saw")

    p = add("review", cmd_review, "each agent commit since BASE: skill, diff stat, runs and outcomes")
    p.add_argument("base", nargs="?", help="a commit or ref (default: the whole history)")

    p = add("audit", cmd_audit, "the latest tool calls from .trainwright/audit.jsonl, oldest first")
    p.add_argument("-n", type=int, default=20, help="entries to show (default 20)")

    p = add("plot", cmd_plot, "write a PNG of a run's loss curve, across resumes (each one marked)")
    p.add_argument("run_id")
    p.add_argument("-o", "--output", help="output file (default: RUN_ID-loss.png)")

    p = add("run", cmd_run, "launch a training run of a recipe folder or of a Python script (launch_run)")
    p.add_argument("recipe", help="recipe folder (with recipe.py), or a training script (a .py file, or a folder "
                   "with a train.py), relative to the workspace; a script's own command line follows -- at the "
                   "end (trainwright run train.py --nproc 2 -- --epochs 3)")
    p.usage = "%(prog)s RECIPE [options] [-- SCRIPT_ARG ...]"
    p.add_argument("--resume-arg", metavar="OPTION", help="a script's option that takes a checkpoint path, "
                   "given with = (--resume-arg=--resume): `trainwright resume` passes the checkpoint with it")
    launch_options(p, 1)
    nodes = p.add_argument_group("several nodes (docs/scaling.md)")
    nodes.add_argument("--nnodes", type=int, default=1, help="nodes of the run; --nproc processes on each (default 1)")
    nodes.add_argument("--rdzv-endpoint", metavar="HOST:PORT",
                       help="c10d rendezvous on the first node, reachable from every node (nnodes > 1)")
    nodes.add_argument("--rdzv-id", metavar="ID", help="rendezvous id (default: node 0's run id; required "
                       "with --node-rank > 0: node 0's run id)")
    nodes.add_argument("--node-rank", type=int, metavar="N", help="0 starts the run (default), others join it")
    nodes.add_argument("--target", choices=("local", "slurm"), default="local",
                       help="local: start here (default); slurm: write runs/<id>/job.sbatch and submit it with sbatch")
    nodes.add_argument("--partition", help="with --target slurm: the partition")
    nodes.add_argument("--time", help="with --target slurm: the time limit (default 01:00:00)")
    nodes.add_argument("--gpus-per-node", type=int, metavar="N", help="with --target slurm: GPUs per node "
                       "(default: --nproc)")
    nodes.add_argument("--rdzv-port", type=int, metavar="PORT", help="with --target slurm: the rendezvous port "
                       "on the job's first node (default 29400)")

    p = add("resume", cmd_resume, "continue a run from its checkpoint as a new run (resume_checkpoint)")
    p.add_argument("run_id")
    p.add_argument("--step", type=int, help="checkpoint step (default: the latest complete one)")
    p.add_argument(
        "--code", choices=("checkpoint", "head"), default="checkpoint",
        help="checkpoint: the code the run ran (default); head: the recipe as it is now",
    )
    launch_options(p, None)

    p = add("runs", cmd_runs, "list runs, newest first (list_runs)")
    p.add_argument("--limit", type=int, default=20, help="at most this many runs, newest first (1-100)")

    p = add("status", cmd_status, "status, latest metrics and checkpoints of a run (get_run)")
    p.add_argument("run_id")

    p = add("tail", cmd_tail, "the latest metrics records of a run (tail_metrics)")
    p.add_argument("run_id")
    p.add_argument("-n", type=int, default=DEFAULT_TAIL_RECORDS,
                   help=f"records to show (default {DEFAULT_TAIL_RECORDS}, at most {MAX_TAIL_RECORDS})")
    p.add_argument("--after-step", type=int, metavar="N", help="only records after step N")
    p.add_argument("--follow", action="store_true", help="keep printing new records until the run ends")
    p.add_argument("--follow-resumes", action="store_true",
                   help="the history across resumes: the runs it was resumed from, up to each resume step")

    p = add("wait", cmd_wait, "wait until a run reaches a step or ends (wait_run); exit 124 on timeout")
    p.add_argument("run_id")
    p.add_argument("--until-step", type=int, metavar="N", help="return once step N is logged (default: the end)")
    p.add_argument("--timeout", type=float, metavar="S", default=DEFAULT_WAIT_S,
                   help=f"give up after S seconds (default {DEFAULT_WAIT_S}, at most {MAX_WAIT_S})")

    p = add("estimate", cmd_estimate, "memory and step time per process before a run, from the model on the meta "
            "device; with --device-memory-gib, whether it fits and which changes would (estimate_run)")
    p.add_argument("recipe", help="recipe folder, relative to the workspace, or its name")
    p.add_argument("--nproc", type=int, default=1, help="processes (FSDP2 ranks)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set model.num_layers=24 (repeatable)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="the device class (default cpu)")
    p.add_argument("--device-memory-gib", type=float, metavar="GIB", help="the memory of one device to fit in")

    p = add("compare", cmd_compare, "b against a: config and code differences, then a verdict per metric "
            "(loss at equal tokens, tokens/s, step time, peak memory) at the noise of their windows (compare_runs)")
    p.add_argument("run_a")
    p.add_argument("run_b")

    p = add("stop", cmd_stop, "stop a run and all its processes (stop_run)")
    p.add_argument("run_id")

    p = add("checkpoints", cmd_checkpoints, "complete checkpoints of a run (list_checkpoints)")
    p.add_argument("run_id")

    p = add("export", cmd_export, "write a checkpoint as a Hugging Face model folder (export_checkpoint)")
    p.add_argument("run_id")
    p.add_argument("--to", required=True, metavar="DIR", help="a new or empty folder in the workspace")
    p.add_argument("--step", type=int, help="checkpoint step (default: the latest complete one)")
    p.add_argument("--lora", choices=("merged", "adapter"), default="merged",
                   help="LoRA runs: adapters merged into the weights (default) or a peft adapter folder")

    p = add("sample", cmd_sample, "continue prompts with a checkpoint's model (sample)")
    p.add_argument("run_id")
    p.add_argument("--prompt", dest="prompts", action="append", required=True, metavar="TEXT",
                   help="text to continue (repeatable, at most 8)")
    p.add_argument("--step", type=int, help="checkpoint step (default: the latest complete one)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="at most this many new tokens each (1-512)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")

    p = add("evaluate", cmd_evaluate, "eval loss and task metrics of a checkpoint (evaluate)")
    p.add_argument("run_id")
    p.add_argument("--step", type=int, help="checkpoint step (default: the latest complete one)")
    p.add_argument("--data", action="append", metavar="PATH",
                   help="evaluate on these files or folders (repeatable; default: the run's held-out split)")
    return parser


class RedactedStream:
    """A text stream that redacts what passes through it and escapes control characters
    (``sandbox.redact.shown``): the CLI prints run output, errors and results, which may hold a
    server secret or a terminal escape sequence the run wrote."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text: str) -> int:
        from sandbox.redact import shown

        self._stream.write(shown(text))
        return len(text)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv, script_args = split_script_args(sys.argv[1:] if argv is None else list(argv))
    args = parser.parse_args(argv)
    args.script_args = script_args
    if args.func is cmd_serve:  # serve speaks MCP on stdout: its tools redact what they return
        return _run(args)
    streams = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = RedactedStream(sys.stdout), RedactedStream(sys.stderr)
    try:
        return _run(args)
    finally:
        sys.stdout, sys.stderr = streams


def split_script_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """``trainwright run SCRIPT [OPTIONS] -- ARGS``: the command line before the first ``--``,
    and the script's own after it (argparse would take the script's options for its own)."""
    if argv[:1] == ["run"] and "--" in argv:
        at = argv.index("--")
        return argv[:at], argv[at + 1:]
    return argv, []


def _run(args: argparse.Namespace) -> int:
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return EXIT_STOPPED
    except BrokenPipeError:  # the reader went away (`trainwright describe ... | head`)
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except TrainwrightError as e:
        return _fail(args, str(e), e.exit_code)
    except Exception as e:  # a bug: say so, with the traceback, and never call it bad input
        import traceback

        traceback.print_exc()
        return _fail(args, f"internal error (a trainwright bug): {type(e).__name__}: {e}", EXIT_INTERNAL)


def _fail(args: argparse.Namespace, message: str, code: int) -> int:
    if getattr(args, "json", False):
        print(json.dumps({"error": message, "exit_code": code}))
    else:
        print(f"error: {message}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
