"""Post-training through MCP: pretrain → export → SFT → DPO → sample, as an agent would do it.

Starts ``trainwright serve`` on a fresh workspace and calls its tools over stdio: pretrain a
tiny byte-level model (``causal_lm``), export it as a Hugging Face folder, fine-tune it on the
``sft`` template's built-in instruction set (with the ``sequence-packing`` skill), evaluate it
(eval loss and held-out answer accuracy), export it, align it with the ``dpo`` template,
evaluate again, and ask the final model a few questions with ``sample`` (greedy). Prints a short
transcript; exits non-zero when anything fails.

    python examples/post_training.py [--workspace DIR] [--pretrain-steps 200] [--sft-steps 300] [--dpo-steps 60]

Takes about 10 minutes on 2 CPU cores (three one-process runs of a small model).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from typing import Any

import anyio
from mcp import Client

sys.path.insert(0, str(Path(__file__).resolve().parent))
from demo import Agent, DemoFailed, say, trainwright_server  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DEFAULT_WORKSPACE = REPO / "post-training-workspace"
SMALL_MODEL = {"model.hidden_size": 128, "model.intermediate_size": 344, "model.num_layers": 2}
QUESTIONS = ["What is 3 + 4?", "Which is larger, 27 or 72?", "Which letter comes after g?", "Is 41 even or odd?"]


async def train(agent: Agent, template: str, name: str, config: dict[str, Any], skills: list[str] = ()) -> str:
    """Scaffold a recipe, launch it, wait for it to complete; return the run id."""
    recipe = await agent.call("scaffold_recipe", template=template, name=name, config=config, skills=list(skills))
    say(f"    created {recipe['path']} (commit {recipe['commit'][:7]})")
    run = await agent.call("launch_run", recipe=recipe["path"])
    run_id = run["run_id"]
    data = run.get("data") or {}
    say(f"    run {run_id}: {data.get('documents', 0):,} documents, {data.get('tokens', 0):,} tokens")
    while True:
        waited = await agent.call("wait_run", quiet=True, run_id=run_id, timeout_s=600)
        if waited["status"] in ("completed", "failed", "stopped"):
            break
    info = await agent.call("get_run", quiet=True, run_id=run_id)
    if info["status"] != "completed":
        raise DemoFailed(f"{name} did not complete: {info['status']} {info.get('error')}")
    last = info["latest"]  # each key's latest value: the loss, and a template's own (dpo: rewards)
    shown = ", ".join(f"{k} {last[k]:.4f}" for k in ("loss", "reward_accuracy", "reward_margin") if k in last)
    say(f"    completed at step {info['step']}: {shown}")
    return run_id


async def export(agent: Agent, run_id: str, folder: str) -> str:
    exported = await agent.call("export_checkpoint", run_id=run_id, to=folder)
    say(f"    exported step {exported['step']} to {exported['path']}: {exported['parameters']:,} parameters, "
        f"tokenizer {exported.get('tokenizer') or 'none'}, {len(exported['files'])} files")
    return folder


async def evaluate(agent: Agent, run_id: str) -> dict[str, Any]:
    result = await agent.call("evaluate", run_id=run_id)
    shown = {k: v for k, v in result.items() if isinstance(v, (int, float, dict))}
    say(f"    {shown}")
    return result


async def post_training(workspace: Path, pretrain_steps: int, sft_steps: int, dpo_steps: int) -> None:
    say(f"$ trainwright serve --workspace {workspace.name}")
    async with Client(trainwright_server(workspace)) as client:
        agent = Agent(client)
        base = await train(agent, "causal_lm", "base_lm", {
            **SMALL_MODEL, "train.max_steps": pretrain_steps, "checkpoint.every": pretrain_steps,
        })
        base_folder = await export(agent, base, "exported/base_lm")

        sft = await train(agent, "sft", "chat_sft", {
            "model.pretrained_path": base_folder, "train.max_steps": sft_steps, "checkpoint.every": sft_steps,
        }, skills=["sequence-packing"])
        await evaluate(agent, sft)
        sft_folder = await export(agent, sft, "exported/chat_sft")

        dpo = await train(agent, "dpo", "chat_dpo", {
            "model.pretrained_path": sft_folder, "train.max_steps": dpo_steps, "checkpoint.every": dpo_steps,
        })
        await evaluate(agent, dpo)

        answers = await agent.call("sample", run_id=dpo, prompts=QUESTIONS, max_new_tokens=8, temperature=0)
        if not answers["chat"]:
            raise DemoFailed("sample did not render the prompts with the model's chat template")
        for sample in answers["samples"]:
            say(f"    {sample['prompt']!r} → {sample['completion']!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workspace", type=Path, default=DEFAULT_WORKSPACE)
    parser.add_argument("--pretrain-steps", type=int, default=200)
    parser.add_argument("--sft-steps", type=int, default=300)
    parser.add_argument("--dpo-steps", type=int, default=60)
    args = parser.parse_args()
    if args.workspace.exists():
        shutil.rmtree(args.workspace)
    args.workspace.mkdir(parents=True)
    try:
        anyio.run(post_training, args.workspace, args.pretrain_steps, args.sft_steps, args.dpo_steps)
    except DemoFailed as e:
        say(f"FAILED: {e}")
        raise SystemExit(1)


if __name__ == "__main__":
    main()
