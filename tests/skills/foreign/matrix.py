"""The five foreign scripts × every skill: apply each skill to a copy, then run every copy that
changed (and each script as it is) for 2 steps in one subprocess (``runner.py``).

    python -m tests.skills.foreign.matrix                        # this checkout's skills
    python -m tests.skills.foreign.matrix --skills-root ../other   # another checkout's skills/

Offline shims, and nothing else changed: a tiny Llama with a byte-level tokenizer saved as a model
folder and a 16-line text data set (``shims.py``); ``max_iters=2`` / ``--max_steps 2`` style
arguments; TRL is given ``--bf16 false --gradient_checkpointing false`` (its defaults are on) so
that the baseline is plain fp32 and a skill's change shows; Lightning's module is driven by
``lightning_driver.py`` (random tokens instead of its WikiText-2 download).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from tests.skills.corpus.fetch import fetch
from tests.skills.corpus.harness import _use_skills_root

HERE = Path(__file__).parent
ROOT = HERE.parents[2]
STEPS = 2
SCRIPTS = ("nanogpt", "hf-no-trainer", "lightning", "accelerate", "trl-sft")


def scripts(tmp: Path) -> dict[str, tuple[Path, list[str]]]:
    """name → (the file the skills act on, its command line); ``{file}`` stands for its copy.
    Raises ``CorpusUnavailable`` when the Lightning and TRL files cannot be fetched."""
    corpus = {s.id: s for s in fetch()}
    model, data = str(tmp / "model"), str(tmp / "data")
    return {
        "nanogpt": (ROOT / "tests/skills/recipes/nanogpt_style.py", ["{file}", f"max_iters={STEPS}"]),
        "hf-no-trainer": (HERE / "hf_no_trainer.py", ["{file}", "--model_name_or_path", model, "--max_train_steps", str(STEPS)]),
        "lightning": (corpus["lightning-demo-transformer"].entry, [str(HERE / "lightning_driver.py"), "{file}", str(STEPS)]),
        "accelerate": (HERE / "accelerate_loop.py", ["{file}", "--model_name_or_path", model, "--cpu", "--max_steps", str(STEPS)]),
        "trl-sft": (corpus["trl-sft"].entry, [
            "{file}", "--model_name_or_path", model, "--dataset_name", data, "--output_dir", str(tmp / "out"),
            "--max_steps", str(STEPS), "--per_device_train_batch_size", "2", "--logging_steps", "1", "--report_to", "none",
            "--save_strategy", "no", "--use_cpu", "true", "--bf16", "false", "--gradient_checkpointing", "false",
            "--max_length", "32", "--disable_tqdm", "true"]),
    }


def _apply_all(tmp: str) -> tuple[dict[str, str], list[dict]]:
    from skills import SkillError, apply_skill
    from skills.registry import list_skill_cards

    base = Path(tmp)
    jobs: list[dict] = [{"shim": "tiny_model", "folder": str(base / "model")}, {"shim": "text_dataset", "folder": str(base / "data")}]
    outcomes: dict[str, str] = {}
    for name, (source, argv) in scripts(base).items():
        for skill in [None] + [card.name for card in list_skill_cards()]:
            folder = base / name / (skill or "baseline")
            folder.mkdir(parents=True)
            copy = folder / source.name
            shutil.copyfile(source, copy)
            if skill is not None:
                try:
                    result = apply_skill(skill, copy)
                except SkillError as e:
                    outcomes[f"{name}/{skill}"] = f"refused: {e}"
                    continue
                outcomes[f"{name}/{skill}"] = "applied" if result.changed else f"already: {result.message}"
                if not result.changed:
                    continue
            args = [a.replace("{file}", str(copy)) for a in argv]
            jobs.append({"name": f"{name}/{skill or 'baseline'}", "script": args[0], "argv": args[1:], "cwd": str(folder)})
    return outcomes, jobs


def prepare(tmp: Path, skills_root: str | None = None) -> tuple[dict[str, str], list[dict]]:
    """Each skill applied to a copy of each script: ``{"script/skill": "applied" | "already: …" |
    "refused: …"}`` and the runner's jobs (each baseline and each applied copy)."""
    if not skills_root:
        return _apply_all(str(tmp))
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(1, mp_context=context, initializer=_use_skills_root, initargs=(skills_root,)) as pool:
        return pool.submit(_apply_all, str(tmp)).result()


def run(tmp: Path, jobs: list[dict], timeout: float = 600) -> dict[str, dict]:
    (tmp / "jobs.json").write_text(json.dumps(jobs))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_DATASETS_CACHE": str(tmp / "hf-datasets"),
           "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "tests.skills.foreign.runner", str(tmp / "jobs.json"), str(tmp / "results.json")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"the runner failed:\n{done.stderr[-3000:]}")
    return {r["name"]: r for r in json.loads((tmp / "results.json").read_text())}


def ran(result: dict) -> str:
    """'' when the run took STEPS optimizer steps with finite printed losses, else why not."""
    if result["error"]:
        return result["error"]
    if result["steps"] != STEPS:
        return f"{result['steps']} optimizer steps instead of {STEPS}; output: {result['printed'][-500:]}"
    if not result["finite"]:
        return f"losses {result['losses']}; output: {result['printed'][-500:]}"
    return ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skills-root", help="a checkout whose skills/ to apply (default: this one)")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="foreign-"))
    outcomes, jobs = prepare(tmp, args.skills_root)
    results = run(tmp, jobs)
    for name in SCRIPTS:
        baseline = results[f"{name}/baseline"]
        print(f"{name}: baseline {'ok ' + str(baseline['losses']) if not ran(baseline) else 'FAILS: ' + ran(baseline)[-300:]}")
        for key, status in sorted(outcomes.items()):
            if key.startswith(name + "/"):
                if status == "applied":
                    r = results[key]
                    problem = ran(r)
                    seen = {k: r.get(k) for k in ("checkpointed", "checkpoint_calls", "graphs", "autocast_forwards", "bfloat16_outputs")}
                    status = f"applied, runs {r['losses']} {seen}" if not problem else f"applied, FAILS: {problem[-400:]}"
                print(f"  {key.split('/')[1]:24} {status[:400]}")
    print(f"(copies and results in {tmp})")


if __name__ == "__main__":
    main()
