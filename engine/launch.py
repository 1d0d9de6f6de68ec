"""Entry point: ``python -m engine.launch RECIPE_DIR [--set key=value ...]``.

The same command runs under ``torchrun --nproc-per-node N -m engine.launch ...``. It loads the
recipe (``RECIPE_DIR/recipe.py``, which defines one ``Engine`` subclass), builds its config
(code defaults → ``RECIPE_DIR/config.yaml`` → ``--set``), validates it, and only then creates
or opens the run directory and trains. A config error exits with status 2 before anything
is written.

``--check`` validates without training and prints one JSON line (``{"ok": true, "config": ...,
"fields": [...]}`` or ``{"ok": false, "error": ...}``): the CLI and the MCP server use it to
refuse a bad launch before they create a run directory, and to describe a recipe's config keys
(``fields``: key, type, default, value, description; see ``engine.config.describe_fields``).
``--check --estimate DEVICE`` adds the run's memory and time per process (``engine.estimate``).
``--check --keys-only`` describes the keys of a config that need not be complete yet (a template
before the user has named its model or data): the config is built, not validated against the
data or the model.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import functools
import importlib.util
import json
import os
import signal
import sys
import traceback
from pathlib import Path
from typing import NoReturn

from engine.errors import EXIT_BAD_INPUT, EXIT_OK, EXIT_RUN_FAILED, MAX_ERROR_CHARS, BadInput
from engine.seams import ConfigField, LaunchRefusal, LaunchVerdict


class RecipeError(BadInput):
    """The recipe folder cannot be loaded."""


def load_recipe_class(recipe_dir: Path):
    """Import ``RECIPE_DIR/recipe.py`` and return the one ``Engine`` subclass it defines."""
    from engine.engine import Engine

    recipe_file = Path(recipe_dir) / "recipe.py"
    if not recipe_file.is_file():
        raise RecipeError(f"{recipe_dir} is not a recipe folder: it has no recipe.py")
    module_name = f"trainwright_recipe_{abs(hash(str(recipe_file.resolve())))}"
    spec = importlib.util.spec_from_file_location(module_name, recipe_file)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    # The recipe folder is importable, so a recipe can keep helpers in sibling files.
    sys.path.insert(0, str(Path(recipe_dir).resolve()))
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        where = ""
        if isinstance(e, SyntaxError):
            where = f" (line {e.lineno})"
        raise RecipeError(f"{recipe_file} cannot be imported{where}: {type(e).__name__}: {e}") from e
    classes = [
        obj
        for obj in vars(module).values()
        if isinstance(obj, type)
        and issubclass(obj, Engine)
        and obj is not Engine
        and obj.__module__ == module_name
    ]
    if len(classes) != 1:
        names = ", ".join(c.__name__ for c in classes) or "none"
        hint = ("; a plain training script needs no recipe: launch_run runs a .py file (or a folder's train.py) "
                "as it is, and docs/script-to-recipe.md says what a recipe adds") if not classes else ""
        raise RecipeError(f"{recipe_file} must define exactly one Engine subclass (found: {names}){hint}")
    return classes[0]


def resolve_config(recipe_class, recipe_dir: Path, overrides, config_json: Path | None):
    from engine.config import build_config, load_yaml

    if config_json is not None:
        # A resumed run starts from the exact config of the run it continues.
        from engine import run_dir as rd

        base = rd.RunRecord.model_validate_json(Path(config_json).read_bytes()).config or {}
        return build_config(recipe_class.config_class, None, overrides, base=base)
    yaml_path = Path(recipe_dir) / "config.yaml"
    if yaml_path.is_file():
        load_yaml(yaml_path)  # fail early with the file's name on bad YAML
    return build_config(recipe_class.config_class, yaml_path, overrides)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m engine.launch",
        description="Train a trainwright recipe (also under torchrun --nproc-per-node N).",
    )
    parser.add_argument("recipe_dir", type=Path, help="recipe folder with a recipe.py")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override a config value with a dotted key, e.g. --set train.max_steps=50",
    )
    parser.add_argument("--run-dir", type=Path, help="use this existing run directory")
    parser.add_argument("--resume-from", type=Path, help="checkpoint folder (step-<N>) to resume")
    parser.add_argument("--config-json", type=Path, help="start from this resolved config (JSON)")
    parser.add_argument("--check", action="store_true", help="validate only; print one JSON line")
    parser.add_argument("--nproc", type=int, help="with --check: the number of processes to check for")
    parser.add_argument("--estimate", choices=("cpu", "cuda"),
                        help="with --check: estimate memory and time per process on this device (engine/estimate.py)")
    parser.add_argument("--device-memory-gib", type=float, help="with --estimate: the device memory to fit in")
    parser.add_argument("--keys-only", action="store_true",
                        help="with --check: describe the config's keys without validating it against its data or model")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from engine.config import ConfigError
    from engine.errors import TrainwrightError
    from engine.metrics.optional import check_backends

    world_size = args.nproc if args.check and args.nproc else int(os.environ.get("WORLD_SIZE", "1"))
    try:
        recipe_class = load_recipe_class(args.recipe_dir)
        config = resolve_config(recipe_class, args.recipe_dir, args.overrides, args.config_json)
        if args.check and args.keys_only:
            print(checked(config).model_dump_json())
            return EXIT_OK
        recipe_class.validate_config(config, world_size)
        check_backends(config.metrics)
        if args.resume_from is not None:
            from engine import run_checkpoints

            if run_checkpoints.checkpoint_step(args.resume_from) is None or not (args.resume_from / run_checkpoints.DCP_METADATA).is_file():
                raise ConfigError(f"--resume-from {args.resume_from} is not a complete checkpoint")
        # A direct start (no launcher counted the data) counts it too, to refuse before a run exists.
        data = None
        if args.check:
            from engine.token_store import launch_check

            with launch_check():  # large data is left to the run: only its head is read here
                data = recipe_class.summarize_data(config)
        elif args.run_dir is None:
            data = recipe_class.summarize_data(config)
        if data is not None and data.nothing_to_train():
            raise ConfigError(data.nothing_to_train())
    except (TrainwrightError, OSError) as e:
        # OSError: data the config names that cannot be read (a missing file, a folder).
        message = str(e) if isinstance(e, TrainwrightError) else f"cannot read the data: {e}"
        if args.check:
            print(LaunchRefusal(error=message).model_dump_json())
        elif int(os.environ.get("RANK", "0")) == 0:
            print(f"error: {message}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.check:
        verdict = checked(config, data)
        if args.estimate:
            from engine.estimate import estimate
            from engine.memory import follow_live_memory

            if args.estimate == "cpu":
                follow_live_memory()  # the floor measured under the allocator the run will have (engine/memory.py)
            try:
                verdict.estimate = estimate(recipe_class, config, world_size, args.estimate, args.device_memory_gib)
            except Exception as e:  # the recipe's code on the meta device: say what it could not do
                traceback.print_exc()
                print(LaunchRefusal(error=f"the estimate failed: {type(e).__name__}: {e}"[:MAX_ERROR_CHARS]).model_dump_json())
                return EXIT_RUN_FAILED
        print(verdict.model_dump_json())
        return EXIT_OK
    return train(recipe_class, config, args, data)


def checked(config, data=None) -> LaunchVerdict:
    from engine.config import config_changes, describe_fields

    return LaunchVerdict(
        config=config.model_dump(mode="json"),
        config_changes=config_changes(config),
        fields=[ConfigField.model_validate(field) for field in describe_fields(config)],
        data=data,
    )


def _record_start(run_dir: Path, recipe_class, config, data, world_size: int, device: str, supervised: bool) -> int | None:
    """The main process's start: the run's record, its data prepared (if left to it) and described.
    An exit code when the data is refused, else None."""
    from engine import run_dir as rd
    from engine.config import config_changes

    record = rd.update_run(
        run_dir,
        config=config.model_dump(mode="json"),
        config_changes=config_changes(config),
        world_size=world_size,
        status=rd.RUNNING,
        started_at=rd.utc_now(),
        engine_pid=os.getpid(),
    )
    if record.data is None or record.data.preparing is not None:  # not counted, or left to the run
        try:
            summary = data if data is not None else prepare_data(run_dir, recipe_class, config, record.data)
        except (BadInput, OSError) as e:
            message = str(e) if isinstance(e, BadInput) else f"cannot read the data: {e}"
            print(f"error: {message}", file=sys.stderr, flush=True)
            outcome = {} if supervised else {"status": rd.FAILED, "ended_at": rd.utc_now()}
            rd.update_run(run_dir, error=message[:MAX_ERROR_CHARS], **outcome)
            return EXIT_BAD_INPUT
        if summary is not None:
            record = rd.update_run(run_dir, data=summary)
    print(f"run {run_dir.name}: {world_size} process(es) on {device}", flush=True)
    if record.data is not None:
        print(record.data.describe(), flush=True)
    if record.config_changes:
        shown = ", ".join(f"{k}={json.dumps(v)}" for k, v in list(record.config_changes.items())[:30])
        print(f"config (differs from the recipe's defaults): {shown}", flush=True)
    return None


def train(recipe_class, config, args: argparse.Namespace, data=None) -> int:
    """Train; ``data``: the data summary already counted, if it was."""
    import torch.distributed as dist

    from engine import run_dir as rd
    from engine.distributed import init_distributed, shutdown_distributed
    from engine.errors import TrainwrightError
    from engine.heartbeat import start_heartbeat

    try:
        dist_info = init_distributed(config.parallel.tp, config.parallel.sp)
    except TrainwrightError as e:  # a network the ranks cannot meet on: what to set, not gloo's retries
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if dist_info.device.type == "cpu":
        _tune_cpu_process()
    run_dir = _open_run_dir(args, recipe_class, dist_info)
    # Under a supervisor (which passes --run-dir) the final status is the supervisor's to record,
    # once every process has exited; the engine only records what it knows: error, last step.
    supervised = args.run_dir is not None
    heartbeat = start_heartbeat(dist_info.is_main, functools.partial(end_silent_run, run_dir, supervised, dist_info.is_main))
    if dist_info.is_main:
        refused = _record_start(run_dir, recipe_class, config, data, dist_info.world_size, dist_info.device.type, supervised)
        if refused is not None:
            return refused
    elif (pending := rd.read_run(run_dir).data) is not None and pending.preparing is not None:
        # Wait for the store here, not in a collective with its time limit. The engine then opens
        # the store again; the files' digests taken now are reused (engine.data_files).
        recipe_class.summarize_data(config)
    engine = recipe_class(config, dist_info, run_dir=run_dir, resume_from=args.resume_from)
    finished = False
    try:
        engine.run()
        finished = True
    except BaseException as e:
        if dist_info.is_main:
            traceback.print_exc()
            outcome = {} if supervised else {"status": rd.FAILED, "ended_at": rd.utc_now()}
            error = f"{type(e).__name__}: {e}"
            if isinstance(e, OSError) and e.errno == errno.ENOSPC:  # where, and how much is left there
                error = rd.no_space_message(e.filename or run_dir, error)
            with contextlib.suppress(OSError):  # on a full disk the supervisor says it (runner/supervise.py)
                rd.update_run(run_dir, error=error[:MAX_ERROR_CHARS], **outcome)
        if isinstance(e, KeyboardInterrupt):
            return 130
        # Bad input: a config the recipe refused, a corrupt checkpoint.
        return EXIT_BAD_INPUT if isinstance(e, BadInput) else EXIT_RUN_FAILED
    finally:
        if dist.is_initialized():
            shutdown_distributed(synchronize=finished)
        if heartbeat is not None:
            heartbeat.stop()
    if dist_info.is_main:
        outcome = {} if supervised else {"status": rd.COMPLETED, "ended_at": rd.utc_now()}
        rd.update_run(run_dir, final_step=engine.state.step, **outcome)
    return EXIT_OK


def end_silent_run(run_dir: Path, supervised: bool, is_main: bool, message: str) -> NoReturn:
    """A node of the run stopped answering (:mod:`engine.heartbeat`): the main thread may be
    waiting in a collective for as long as the process group's time limit, so the process ends
    from the heartbeat's thread, its error said first (rank 0's into run.json, as :func:`train`
    records an error). torchrun's agent then stops the node's other processes. On a node cut off
    from node 0 the agent itself waits on the rendezvous store there, for minutes (its read
    timeout, then its close): it has nothing left to do, so it is ended too, and the node's
    sandbox (or its SLURM step) ends the node's other processes with it."""
    from engine import run_dir as rd

    print(f"error: {message}", file=sys.stderr, flush=True)
    if is_main:
        outcome = {} if supervised else {"status": rd.FAILED, "ended_at": rd.utc_now()}
        with contextlib.suppress(OSError):
            rd.update_run(run_dir, error=message[:MAX_ERROR_CHARS], **outcome)
    sys.stdout.flush()
    if not is_main and "TORCHELASTIC_RUN_ID" in os.environ:  # started by torchrun's agent, our parent
        with contextlib.suppress(OSError):
            os.kill(os.getppid(), signal.SIGKILL)
    os._exit(EXIT_RUN_FAILED)


def _tune_cpu_process() -> None:
    """A CPU run's process: glibc's allocator (with TRAINWRIGHT_MMAP_THRESHOLD the resident set
    follows live bytes) and OpenMP's waits (spin on free cores, throttle beside competitors)."""
    import torch

    from engine.memory import follow_live_memory
    from engine.openmp import govern_waits

    follow_live_memory()
    govern_waits(torch.get_num_threads())


def prepare_data(run_dir: Path, recipe_class, config, pending):
    """The data summary, counted as the run's first phase: the launch check left the data to the
    run (``pending``: what it found; the store's build reports its progress into run.json as
    ``data.preparing``), or no launcher counted it. Data with nothing to train is refused as
    the launch check refuses it."""
    from engine import run_dir as rd
    from engine.config import ConfigError
    from engine.token_store import reporting

    def report(progress: dict) -> None:
        rd.update_run(run_dir, data=pending.model_copy(update={"preparing": rd.DataPreparation(**progress)}))

    with reporting(report) if pending is not None else contextlib.nullcontext():
        summary = recipe_class.summarize_data(config)
    if summary is not None and summary.nothing_to_train():
        raise ConfigError(summary.nothing_to_train())
    return summary


def _open_run_dir(args: argparse.Namespace, recipe_class, dist_info) -> Path:
    """The run directory given by ``--run-dir``, or a new ``runs/<id>`` in the current directory."""
    import torch.distributed as dist

    from engine import run_dir as rd
    from engine.config import overrides_to_dict

    if args.run_dir is not None:
        return args.run_dir
    holder = [None]
    if dist_info.is_main:
        recipe_dir = args.recipe_dir.resolve()
        run_id = rd.new_run_id(recipe_dir.name)
        path = Path.cwd() / rd.RUNS_DIRNAME / run_id
        rd.create_run(
            path,
            rd.RunRecord(
                id=run_id,
                recipe=str(args.recipe_dir),
                overrides=overrides_to_dict(args.overrides),
                nproc=dist_info.world_size,
                created_at=rd.utc_now(),
                pid=os.getpid(),  # no supervisor: the engine's own rank 0 stands for the run
            ),
        )
        holder[0] = str(path)
    if dist_info.world_size > 1:
        dist.broadcast_object_list(holder, src=0)
    return Path(holder[0])


def exit_without_finalizing(code: int) -> NoReturn:
    """End the process once its work is on disk, skipping the interpreter's finalization.

    While Python finalizes, gloo's C++ worker threads may still drop the last reference to a
    tensor that has a Python object; taking the GIL then kills the thread, and the process dies
    with SIGABRT ("terminate called without an active exception") after a run that trained and
    saved everything. Here 2 of 8 tensor-parallel 2-process runs died that way; with this exit,
    0 of 32. What a normal exit does that matters (atexit hooks: logging, torch's compile
    workers; the standard streams) is done first. The engine has closed its own files by now.
    """
    import atexit

    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    from engine.openmp import prepare_wait_policy

    prepare_wait_policy()  # before anything imports torch: libgomp reads it once, as it loads
    exit_without_finalizing(main())
