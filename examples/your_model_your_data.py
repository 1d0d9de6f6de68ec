"""Your model, your data, through MCP: a Hugging Face model folder → SFT with LoRA on a parquet
file → evaluate → export, as an agent would do it.

Starts ``trainwright serve`` on a fresh workspace and calls its tools over stdio. The model is
``--model DIR`` (any transformers causal LM folder with a tokenizer and chat template: Qwen2.5,
Llama 3, Gemma 2, Mistral, Phi-3, SmolLM, ...), copied to ``models/`` in the workspace; without
it, a tiny random-weight Qwen2-family model is built offline (a byte-level BPE trained on the
spot, Qwen's ChatML template, which has no ``{% generation %}`` markers). The data is
``--data FILE`` (a .parquet, .jsonl, .json, .csv or .tsv of messages, ShareGPT, Alpaca or
prompt/completion records), copied to ``data/``; without it, a parquet file of small sums is
written. Prints a short transcript; exits non-zero when anything fails.

    python examples/your_model_your_data.py [--workspace DIR] [--model DIR] [--data FILE] [--steps 20]

With the tiny model: about a minute on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import anyio
from mcp import Client

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from demo import Agent, DemoFailed, say, trainwright_server  # noqa: E402

DEFAULT_WORKSPACE = REPO / "your-model-workspace"


def prepare(workspace: Path, model: Path | None, data: Path | None) -> tuple[str, str]:
    """The model folder and data file, inside the workspace (where a run may read)."""
    models, data_dir = workspace / "models", workspace / "data"
    data_dir.mkdir(parents=True)
    if model is not None:
        shutil.copytree(model, models / model.name)
        model_path = f"models/{model.name}"
    else:
        sys.path.insert(0, str(REPO))
        from tests.model_families import tiny_model_folder

        tiny_model_folder(models / "tiny-qwen", "qwen2")
        model_path = "models/tiny-qwen"
    if data is not None:
        shutil.copy(data, data_dir / data.name)
        return model_path, f"data/{data.name}"
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"messages": [{"role": "user", "content": f"What is {a} + {b}?"},
                          {"role": "assistant", "content": f"It is {a + b}."}]} for a in range(10) for b in range(10)]
    pq.write_table(pa.Table.from_pylist(rows), data_dir / "sums.parquet")
    return model_path, "data/sums.parquet"


async def flow(workspace: Path, model_path: str, data_path: str, steps: int) -> None:
    say(f"$ trainwright serve --workspace {workspace.name}")
    async with Client(trainwright_server(workspace)) as client:
        agent = Agent(client)
        recipe = await agent.call("scaffold_recipe", template="sft", name="my_chat", config={
            "model.pretrained_path": model_path, "data.paths": [data_path], "data.seq_len": 128,
            "data.batch_size": 8, "data.eval_fraction": 0.1, "data.eval_prompts": 8, "data.max_new_tokens": 8,
            "train.max_steps": steps, "checkpoint.every": steps, "optim.lr": 1e-3,
        }, skills=["lora"])
        say(f"    created {recipe['path']} with {[s['skill'] for s in recipe['skills']]}")
        run = await agent.call("launch_run", recipe=recipe["path"])
        data = run.get("data") or {}
        say(f"    data: {data.get('documents', 0):,} conversations, format {data.get('format')}, loss on "
            f"{data.get('mask')} ({data.get('loss_tokens', 0):,} tokens), {data.get('truncated', 0)} truncated, "
            f"{data.get('dropped', 0)} dropped")
        info = await agent.wait_until_ended(run["run_id"])
        if info["status"] != "completed":
            raise DemoFailed(f"the run did not complete: {info['status']} {info.get('error')}")
        say(f"    completed at step {info['step']}: loss {info['latest'].get('loss', float('nan')):.4f}")
        evaluated = await agent.call("evaluate", run_id=run["run_id"])
        say(f"    eval loss {evaluated['eval_loss']:.4f}, metrics {evaluated['metrics']}")
        exported = await agent.call("export_checkpoint", run_id=run["run_id"], to="exported/my_chat")
        say(f"    exported to {exported['path']}: {exported['parameters']:,} parameters, LoRA merged")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workspace", type=Path, default=DEFAULT_WORKSPACE)
    parser.add_argument("--model", type=Path, default=None, help="a Hugging Face model folder")
    parser.add_argument("--data", type=Path, default=None, help="a data file")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    if args.workspace.exists():
        shutil.rmtree(args.workspace)
    args.workspace.mkdir(parents=True)
    model_path, data_path = prepare(args.workspace, args.model, args.data)
    try:
        anyio.run(flow, args.workspace, model_path, data_path, args.steps)
    except DemoFailed as e:
        say(f"FAILED: {e}")
        raise SystemExit(1)


if __name__ == "__main__":
    main()
