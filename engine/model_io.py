"""Models out, and questions to them: ``python -m engine.model_io export|sample|evaluate RUN_DIR``.

Each command builds the recipe's engine from the run's code snapshot (``RUN_DIR/recipe``) and
resolved config (``RUN_DIR/run.json``), as one process (world size 1, CUDA where there is one,
else CPU, full precision, no tensor parallelism), loads the model of the checkpoint at
``--step`` (DCP: written by any number of processes), and then:

- ``export --to DIR``: a Hugging Face folder (``engine.hf_export``);
- ``sample --prompt TEXT ...``: greedy (``--temperature 0``) or sampled continuations, each at
  most ``--max-new-tokens`` tokens (a tokenizer with a chat template: each prompt is a user
  turn, rendered by the template with the generation prompt; a recipe whose model needs more
  than text gives the inputs itself, ``Engine.sample_inputs``);
- ``evaluate [--data PATH ...]``: the eval loss on the recipe's held-out batches (or on the
  documents of ``PATH``: ``data.paths`` with every document held out) and the recipe's
  ``task_metrics()``; ``evaluate --task NAME ...``: lm-evaluation-harness's scores on those
  tasks instead (``engine.benchmarks``).

It runs recipe code, so trainwright starts it in the run sandbox (``runner.model_process``),
where the only writable places are ``--to`` and the folder of ``--result``: the result is one
JSON object written to ``--result`` (stdout without it), one of :mod:`engine.seams`' models: an
``ExportOutcome``, ``SampleOutcome`` or ``EvaluateOutcome`` (``{"ok": true, ...}``), or a
``ModelRefusal`` (``{"ok": false, "kind": "bad_input" | "not_found" | "failed", "error": ...}``).
"""

from __future__ import annotations

import argparse
import inspect
import math
import os
import shutil
import sys
import traceback
from pathlib import Path
from typing import Any, Callable

from engine import run_dir as rd
from engine import run_checkpoints
from engine.errors import (
    EXIT_BAD_INPUT,
    EXIT_OK,
    EXIT_RUN_FAILED,
    MAX_ERROR_CHARS,
    BadInput,
    NotFound,
    TrainwrightError,
)
from engine.hf_checkpoint import load_checkpoint_model
from engine.seams import (
    GGUF_QUANTIZATIONS,
    LORA_CHOICES,
    MAX_COMPLETION_CHARS,
    MAX_METRIC_NAME_CHARS,
    MAX_METRICS,
    MAX_NAME_CHARS,
    MAX_NEW_TOKENS,
    MAX_PROMPT_CHARS,
    MAX_PROGRESS_CHARS,
    MAX_PROMPTS,
    MAX_SHOWN_CHARS,
    EvaluateOutcome,
    ExportOutcome,
    GeneratedSample,
    ModelOutcome,
    ModelProgress,
    ModelRefusal,
    SampleOutcome,
)

# The folder inside an export's destination that a GGUF file is converted from, then removed.
GGUF_STAGING = ".hf"
# Below this, logits / temperature overflow (inf, then NaN probabilities): 0 is greedy.
MIN_TEMPERATURE = 0.01
# One process computes what a run computed on many: the same weights in full precision.
SINGLE_PROCESS = {
    "parallel.tp": 1,
    "parallel.sp": 1,
    "parallel.param_dtype": "float32",
    "parallel.reduce_dtype": "float32",
    "parallel.fsdp_on_one_process": False,
}


def checkpoint_path(run_dir: Path, step: int) -> Path:
    path = Path(run_dir) / rd.CHECKPOINTS_DIRNAME / run_checkpoints.checkpoint_dir_name(step)
    if not (path / run_checkpoints.DCP_METADATA).is_file():
        raise NotFound(f"run {Path(run_dir).name} has no complete checkpoint at step {step}")
    return path


def script_checkpoint(run_dir: Path, step: int) -> Path:
    """The checkpoint of a script run at ``step``: what its script saved under ``checkpoints/``."""
    found = dict(run_checkpoints.list_script_checkpoints(run_dir))
    if step not in found:
        raise NotFound(f"run {Path(run_dir).name} has no checkpoint at step {step}")
    return found[step]


def load_engine(run_dir: Path, step: int, overrides: dict[str, Any] | None = None, recipe: Path | None = None):
    """The run's recipe engine (``recipe``: its code, default the run's snapshot), its model
    built and loaded with the checkpoint of ``step``; a script run's checkpoint folder as a
    :class:`~engine.hf_checkpoint.CheckpointModel`."""
    import torch

    from engine.config import build_config
    from engine.distributed import DistInfo, pick_device
    from engine.launch import load_recipe_class

    run_dir = Path(run_dir)
    record = rd.read_run(run_dir)
    if record.kind == rd.SCRIPT:  # its checkpoint is a model folder: transformers loads it, no script code
        return load_checkpoint_model(script_checkpoint(run_dir, step), record.id)
    if not record.config:
        raise NotFound(f"run {record.id} recorded no config, so its recipe cannot be rebuilt")
    recipe_class = load_recipe_class(recipe or run_dir / rd.SNAPSHOT_DIRNAME)
    config = build_config(recipe_class.config_class, None, {**SINGLE_PROCESS, **(overrides or {})},
                          base=record.config)
    device = pick_device(0)
    engine = recipe_class(config, DistInfo(0, 1, 0, device, None))
    torch.manual_seed(config.train.seed)
    engine.model = engine.prepare_model()
    load_model_weights(engine.model, checkpoint_path(run_dir, step))
    engine.model.eval()
    return engine


def load_model_weights(model, checkpoint: Path) -> None:
    """The model part of a checkpoint (``model_optim.model``, as ``Engine.checkpoint_states``
    saves it) into ``model``; DCP reshards whatever world size wrote it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from engine.checkpoint import model_state_options, root_cause, verify_checkpoint, without_quantization_state

    verify_checkpoint(checkpoint)  # every file as saved, or CheckpointCorrupt naming the file
    options = model_state_options(model)  # a quantised model's checkpoint holds its adapters
    state = without_quantization_state(model, get_model_state_dict(model, options=options))
    try:
        dcp.load({"model_optim": {"model": state}}, checkpoint_id=str(checkpoint))
    except BaseException as e:  # DCP's CheckpointException (a BaseException) wraps the cause
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        cause = root_cause(e)
        what = f"{type(cause).__name__}: {cause}".splitlines()[0][:500]
        raise BadInput(f"the model in checkpoint {checkpoint.name} of run {checkpoint.parent.parent.name} "
                       f"cannot be loaded into the recipe's model ({what})") from e
    set_model_state_dict(model, state, options=options)


# ---------------------------------------------------------------------------------------------
# The three commands
# ---------------------------------------------------------------------------------------------


def export(run_dir: Path, step: int, to: Path, lora: str = "merged", max_shard_size: str = "2GB",
           final_dir: Path | None = None, gguf: str | None = None) -> ExportOutcome:
    """A Hugging Face folder at ``to``; or (``gguf``: a GGUF type) that folder, LoRA merged,
    written as one GGUF file of that type into ``to`` and then removed."""
    from engine import hf_export

    if lora not in LORA_CHOICES:
        raise BadInput(f"lora must be one of {', '.join(LORA_CHOICES)}, got {lora!r}")
    if gguf is not None and gguf not in GGUF_QUANTIZATIONS:
        raise BadInput(f"gguf must be one of {', '.join(GGUF_QUANTIZATIONS)}, got {gguf!r}")
    if gguf is not None and lora == "adapter":
        raise BadInput("a GGUF file holds the merged model: leave lora out (merged) with gguf")
    engine = load_engine(run_dir, step)
    folder = Path(to) / GGUF_STAGING if gguf else Path(to)
    written = hf_export.export(engine.hf_model(), engine.hf_processing(), folder, lora=lora,
                               max_shard_size=max_shard_size, final_dir=final_dir)
    tokenizer = written.pop("tokenizer")
    if gguf:
        from engine.gguf_export import gguf_file_name, write_gguf

        write_gguf(folder, Path(to) / gguf_file_name(gguf), gguf, name=(final_dir or Path(to)).name)
        shutil.rmtree(folder)
    return ExportOutcome(step=step, tokenizer=None if tokenizer is None else tokenizer[:MAX_NAME_CHARS], gguf=gguf,
                         **written)


def sample_inputs(engine, index: int, prompt: str, image: str | None):
    """The recipe's inputs for prompt ``index`` (a vision-language recipe adds an image: a held-out
    one, or ``image``); None: the prompt is text. An image for a recipe that takes none is refused."""
    if image is None:
        return engine.sample_inputs(index, prompt)
    if "image" not in inspect.signature(engine.sample_inputs).parameters:
        raise BadInput(f"the run's recipe ({type(engine).__name__}) takes no image in sample: give prompts only")
    return engine.sample_inputs(index, prompt, image=image)


def sample(run_dir: Path, step: int, prompts: list[str], max_new_tokens: int = 64,
           temperature: float = 0.0, seed: int = 0, reasoning: bool | None = None,
           images: list[str] | None = None) -> SampleOutcome:
    """``reasoning``: the chat template's switch (``enable_thinking``, Qwen3's) on or off; None:
    the template's default. ``images``: one image file per prompt, for a recipe whose
    ``sample_inputs`` takes an ``image`` (a vision-language one)."""
    import torch

    from engine.chat import parse_completion

    from engine.hf_export import set_special_tokens, text_tokenizer

    check_sample_request(prompts, max_new_tokens, temperature)
    if images is not None and len(images) != len(prompts):
        raise BadInput(f"give one image per prompt: {len(images)} images for {len(prompts)} prompts")
    engine = load_engine(run_dir, step)
    processing = engine.hf_processing()
    if processing is None:
        raise BadInput("the run's recipe has no tokenizer (hf_processing() returns None, e.g. data.source=random): "
                       "there is no text to sample")
    tokenizer = text_tokenizer(processing)
    model = engine.hf_model()
    set_special_tokens(model, processing)
    torch.manual_seed(seed)
    # A tokenizer with a chat template belongs to a chat model (SFT, DPO): each prompt is a user turn.
    chat = bool(getattr(tokenizer, "chat_template", None))
    switch = {} if reasoning is None else {"enable_thinking": reasoning}
    if switch and not (chat and "enable_thinking" in str(tokenizer.chat_template)):
        raise BadInput("this model's chat template has no reasoning switch (enable_thinking): sample without reasoning")
    samples = []
    for index, prompt in enumerate(prompts):
        given = sample_inputs(engine, index, prompt, None if images is None else images[index])
        inputs, about = given if given is not None else ({}, {})
        if given is not None:
            ids = inputs.pop("input_ids")
        elif chat:
            ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                return_tensors="pt", return_dict=True, **switch)["input_ids"]
        else:
            ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
        ids = ids.to(engine.device)
        inputs = {key: value.to(engine.device) for key, value in inputs.items()}
        with torch.no_grad():
            output = model.generate(
                ids, attention_mask=torch.ones_like(ids), **inputs, max_new_tokens=max_new_tokens,
                do_sample=temperature > 0, temperature=temperature if temperature > 0 else None,
                top_k=None, top_p=None, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
            )
        new = output[0, ids.shape[1]:].tolist()
        ended = tokenizer.eos_token_id is not None and tokenizer.eos_token_id in new
        # What the recipe shows beside a sample is its data's (an answer may be long): cut here,
        # the server cuts it further to its share of the result.
        shown = {key: about[key][:MAX_SHOWN_CHARS] for key in ("input", "expected") if isinstance(about.get(key), str)}
        completion = tokenizer.decode(new, skip_special_tokens=True)
        written = {}
        if chat:  # the completion as written, and parsed: reasoning, calls, the answer
            raw = tokenizer.decode(new, skip_special_tokens=False)
            parsed = parse_completion(raw, tokenizer.eos_token)
            if parsed["reasoning"] is not None or parsed["tool_calls"]:
                completion = parsed["content"]
            written = {"raw": raw[:MAX_COMPLETION_CHARS], "tool_calls": parsed["tool_calls"],
                       "reasoning": None if parsed["reasoning"] is None else parsed["reasoning"][:MAX_COMPLETION_CHARS]}
        samples.append(GeneratedSample(
            prompt=prompt, **shown, completion=completion[:MAX_COMPLETION_CHARS],
            new_tokens=len(new), stopped="eos" if ended else "max_new_tokens", **written,
        ))
    return SampleOutcome(step=step, temperature=temperature, chat=chat, samples=samples)


def check_sample_request(prompts: Any, max_new_tokens: Any, temperature: Any) -> None:
    """The bounds of a sample request, each defined once: the server's ``sample`` tool checks the
    same functions on its arguments (:class:`mcp_server.arguments.SampleArgs`), before starting
    anything; this process checks its command line with them."""
    check_prompts(prompts)
    check_max_new_tokens(max_new_tokens)
    check_temperature(temperature)


def check_prompts(prompts: Any) -> None:
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) for p in prompts):
        raise BadInput("prompts must be a non-empty list of strings")
    if len(prompts) > MAX_PROMPTS:
        raise BadInput(f"at most {MAX_PROMPTS} prompts at a time, got {len(prompts)}")
    for index, prompt in enumerate(prompts):
        if not prompt:
            raise BadInput(f"prompt {index} is empty; give the text the model continues")
        if "\x00" in prompt:
            raise BadInput(f"prompt {index} contains a NUL character")
        try:  # a JSON string may hold a lone surrogate, which no command line can carry
            prompt.encode()
        except UnicodeEncodeError:
            raise BadInput(f"prompt {index} is not valid text (it holds a lone surrogate)") from None
        if len(prompt) > MAX_PROMPT_CHARS:
            raise BadInput(f"prompt {index} has {len(prompt)} characters; at most {MAX_PROMPT_CHARS}")


def check_max_new_tokens(max_new_tokens: Any) -> None:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or not 1 <= max_new_tokens <= MAX_NEW_TOKENS:
        raise BadInput(f"max_new_tokens must be an integer between 1 and {MAX_NEW_TOKENS}, got {max_new_tokens!r}")


def check_temperature(temperature: Any) -> None:
    if (isinstance(temperature, bool) or not isinstance(temperature, (int, float))
            or not (temperature == 0 or MIN_TEMPERATURE <= temperature <= 5)):
        raise BadInput(f"temperature must be 0 (greedy) or a number between {MIN_TEMPERATURE} and 5, "
                       f"got {temperature!r}")


def evaluation_overrides(config_fields: dict[str, Any], data: list[str] | None) -> dict[str, Any]:
    """Config overrides that make a recipe evaluate: ``train.eval_every`` on (recipes build
    their evaluation batches only then) and, with ``data``, those documents, all held out."""
    overrides: dict[str, Any] = {"train.eval_every": max(1, int(config_fields["train"]["eval_every"]))}
    if data:
        data_section = config_fields.get("data", {})
        missing = [key for key in ("paths", "eval_fraction") if key not in data_section]
        if missing:
            raise BadInput(f"the recipe's config has no data.{missing[0]}, so evaluate cannot be given data; "
                           "evaluate without data uses the recipe's held-out split")
        overrides.update({"data.paths": list(data), "data.eval_fraction": 1.0})
        if "source" in data_section:
            overrides["data.source"] = "files"
    return overrides


def evaluate(run_dir: Path, step: int, data: list[str] | None = None,
             tasks: list[str] | None = None, progress: Path | None = None) -> EvaluateOutcome:
    """``progress``: a file a line is appended to as each task starts (:class:`~engine.seams.ModelProgress`)."""
    import torch

    if tasks:
        return evaluate_tasks(run_dir, step, tasks, data, progress_writer(progress))
    record = rd.read_run(run_dir)
    if record.kind == rd.SCRIPT:
        return _evaluate_script_checkpoint(run_dir, step, record, data)
    engine = load_engine(run_dir, step, evaluation_overrides(record.config or {}, data))
    engine.eval_batches = engine.prepare_eval_data()
    if not engine.eval_batches:
        raise BadInput("the recipe has no evaluation data (prepare_eval_data() returned nothing: "
                       "no documents held out?); pass data=[files] to evaluate on")
    scored = sum(engine.count_loss_tokens(batch) for batch in engine.eval_batches)
    loss = engine.evaluate()
    engine.model.eval()
    with torch.no_grad():
        computed = {str(k)[:MAX_METRIC_NAME_CHARS]: float(v) for k, v in engine.task_metrics().items()}
    # The first MAX_METRICS finite ones, in the recipe's order.
    metrics = dict(list((k, v) for k, v in computed.items() if math.isfinite(v))[:MAX_METRICS])
    finite_loss = float(loss) if math.isfinite(loss) else None
    return EvaluateOutcome(
        step=step,
        eval_loss=finite_loss,
        perplexity=math.exp(finite_loss) if finite_loss is not None and finite_loss < 50 else None,
        batches=len(engine.eval_batches),
        split="data" if data else "held_out",
        **split_summary(engine, record, data),
        scored_tokens=scored,
        data=list(data) if data else None,
        metrics=metrics,
    )


def evaluate_tasks(run_dir: Path, step: int, tasks: list[str], data: list[str] | None = None,
                   report: Callable[[int, int, str], None] | None = None) -> EvaluateOutcome:
    """lm-evaluation-harness's scores of the checkpoint (a recipe's or a script's) on ``tasks``,
    defined by lm-eval or in the workspace's task folder (the process's working directory);
    ``report`` is told each task as it starts."""
    from engine import benchmarks
    from engine.data_files import allowed_root

    if data:
        raise BadInput("evaluate takes data or tasks, not both: call it once for each")
    benchmarks.check_tasks(tasks)
    scored = benchmarks.score(lambda: load_engine(run_dir, step), tasks, allowed_root() or Path.cwd(), report=report)
    return EvaluateOutcome(step=step, eval_loss=None, perplexity=None, batches=0, split="tasks", scored_tokens=0,
                           tasks=scored)


def progress_writer(path: Path | None) -> Callable[[int, int, str], None] | None:
    """A function that appends a :class:`~engine.seams.ModelProgress` line to ``path``."""
    if path is None:
        return None

    def report(done: int, total: int, message: str) -> None:
        with open(path, "a") as f:
            f.write(ModelProgress(done=done, total=total, message=message[:MAX_PROGRESS_CHARS]).model_dump_json() + "\n")

    return report


def _evaluate_script_checkpoint(run_dir: Path, step: int, record: rd.RunRecord,
                                data: list[str] | None) -> EvaluateOutcome:
    """A script run's model folder on the files of ``data`` (a script has no held-out split
    trainwright knows)."""
    from engine.hf_checkpoint import evaluate_model

    if not data:
        raise BadInput(f"run {record.id} ran a script, whose held-out data trainwright does not know: "
                       "pass data=[files or folders] to evaluate its checkpoint on")
    numbers = evaluate_model(load_engine(run_dir, step), data)
    loss = numbers.pop("eval_loss")
    metrics = {k: v for k, v in numbers.pop("metrics").items() if math.isfinite(v)}
    return EvaluateOutcome(step=step, eval_loss=loss, perplexity=math.exp(loss) if loss is not None and loss < 50
                           else None, batches=numbers["examples"], split="data", data=list(data), metrics=metrics,
                           **numbers)


def split_summary(engine: Any, record: rd.RunRecord, data: list[str] | None) -> dict[str, Any]:
    """``examples``, ``tokens`` and ``loss_tokens`` of the split evaluated, counted as the launch's
    data summary counts them (:class:`engine.run_dir.DataSummary`): the run's held-out split as
    its launch counted it, or the files given (all held out) counted now."""
    if not data:
        summary = record.data if record.data is not None else type(engine).summarize_data(engine.config)
        if summary is None:
            return {"examples": None, "tokens": None, "loss_tokens": None}
        examples, tokens, loss_tokens = summary.eval_documents, summary.eval_tokens, summary.eval_loss_tokens
    else:
        # The files given are all held out; a recipe refuses to count a split with nothing to
        # train on, so they are counted as if all trained on: the same documents, the same counts.
        config = engine.config.model_copy(deep=True)
        config.data.eval_fraction = 0.0
        summary = type(engine).summarize_data(config)
        if summary is None:
            return {"examples": None, "tokens": None, "loss_tokens": None}
        examples, tokens, loss_tokens = summary.train_documents, summary.train_tokens, summary.train_loss_tokens
    return {"examples": examples, "tokens": tokens, "loss_tokens": tokens if loss_tokens is None else loss_tokens}


# ---------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m engine.model_io", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="action", required=True)

    def command(name: str, help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help)
        p.add_argument("run_dir", type=Path, help="the run directory (runs/<id>)")
        p.add_argument("--step", type=int, required=True, help="the checkpoint's step")
        p.add_argument("--result", type=Path, help="write the result (one JSON object) here; default stdout")
        return p

    p = command("export", "write the checkpoint as a Hugging Face folder")
    p.add_argument("--to", type=Path, required=True, help="an empty or new folder")
    p.add_argument("--lora", choices=("merged", "adapter"), default="merged")
    p.add_argument("--max-shard-size", default="2GB", help="safetensors shards above this (e.g. 500MB)")
    p.add_argument("--final-dir", type=Path, help="where --to will be renamed to (an adapter's base is named there)")
    p.add_argument("--gguf", choices=GGUF_QUANTIZATIONS, help="write one GGUF file of this type instead")
    p = command("sample", "continue prompts with the model")
    p.add_argument("--prompt", dest="prompts", action="append", required=True)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reasoning", choices=("on", "off"), help="the chat template's reasoning switch; default: its own")
    p.add_argument("--image", dest="images", action="append", help="an image file per prompt (vision-language recipes)")
    p = command("evaluate", "eval loss and the recipe's task metrics, or lm-eval's scores on tasks")
    p.add_argument("--data", action="append", help="evaluate on these files or folders (all held out)")
    p.add_argument("--task", dest="tasks", action="append", help="an lm-eval task (repeatable): its scores instead")
    p.add_argument("--progress", type=Path, help="with --task: append a JSON line here as each task starts")
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> ModelOutcome:
    if args.action == "export":
        return export(args.run_dir, args.step, args.to, args.lora, args.max_shard_size, args.final_dir, args.gguf)
    if args.action == "sample":
        reasoning = None if args.reasoning is None else args.reasoning == "on"
        return sample(args.run_dir, args.step, args.prompts, args.max_new_tokens, args.temperature, args.seed, reasoning,
                      args.images)
    return evaluate(args.run_dir, args.step, args.data, args.tasks, args.progress)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result: ModelOutcome | ModelRefusal
    try:
        result, code = run(args), EXIT_OK
    except (TrainwrightError, OSError) as e:
        kind = "bad_input" if isinstance(e, OSError) else "failed" if e.kind == "internal" else e.kind
        message = str(e) if isinstance(e, TrainwrightError) else f"cannot read the data: {e}"
        result, code = ModelRefusal(kind=kind, error=message[:MAX_ERROR_CHARS]), EXIT_BAD_INPUT
    except BaseException as e:  # recipe code failed (DCP's CheckpointException is a BaseException)
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        traceback.print_exc()
        result = ModelRefusal(kind="failed", error=f"{type(e).__name__}: {e}"[:MAX_ERROR_CHARS])
        code = EXIT_RUN_FAILED
    text = result.model_dump_json()
    if args.result is None:
        print(text)
    else:
        temporary = args.result.with_name(args.result.name + ".tmp")
        temporary.write_text(text)
        os.replace(temporary, args.result)
    return code


if __name__ == "__main__":
    sys.stdout.flush()
    from engine.launch import exit_without_finalizing
    from engine.openmp import govern_waits, prepare_wait_policy

    prepare_wait_policy()  # before anything imports torch: libgomp reads it once, as it loads
    import torch

    govern_waits(torch.get_num_threads())
    exit_without_finalizing(main())
