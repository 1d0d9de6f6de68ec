"""Workflows as MCP prompts, and completions of their arguments and of ``run://`` URIs.

A client lists prompts as commands (Claude Code: slash commands). Each prompt is the text an
agent follows: the tools in the order they are called, with the arguments filled in from the
prompt's own. Completions answer from the workspace as it is now (its recipes and runs), the
templates and the skills; at most :data:`MAX_COMPLETIONS` values, the spec's limit.
"""

from __future__ import annotations

from typing import Annotated, Any

from mcp.server.mcpserver import MCPServer
from mcp_types import Completion, PromptReference, ResourceTemplateReference
from pydantic import Field

from sandbox.redact import printable
from workspace.workspace import Workspace

MAX_COMPLETIONS = 100  # completion/complete returns at most 100 values
MAX_ARGUMENT_CHARS = 300  # a prompt argument is a name, an id or a path: longer is cut


def _quoted(value: str) -> str:
    """An argument as it appears in a prompt's text: printable, bounded, JSON-quoted."""
    text = printable(value.strip())[:MAX_ARGUMENT_CHARS]
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def finetune(
    model: Annotated[str, Field(description="A Hub id (org/name[@rev]) or a model folder in the workspace.")],
    data: Annotated[str, Field(description="A data file or folder in the workspace, or a Hub data set id.")],
    template: Annotated[str, Field(description="sft (default), dpo, causal_lm or vlm (grpo: the reinforce prompt).")] = "sft",
    name: Annotated[str, Field(description="The recipe's name (default: finetune).")] = "finetune",
) -> str:
    recipe, exported = _quoted(f"recipes/{name.strip()}"), _quoted(f"exports/{name.strip()}")
    model, data, template, name = _quoted(model), _quoted(data), _quoted(template), _quoted(name)
    return f"""Fine-tune {model} on {data} with trainwright's {template} template, step by step:
1. describe_recipe(recipe={template}): read the config keys, and which data formats it reads.
2. scaffold_recipe(template={template}, name={name}, config={{"model.pretrained_path": {model}, \
"data.paths": [{data}], "train.max_steps": 20, "train.log_every": 2}}); for a Hub data set id use \
"data.dataset": {data} instead of data.paths.
3. apply_skill(skill="lora", recipe={recipe}) for a model of more than ~100 M \
parameters, and apply_skill(skill="gradient-checkpointing", ...) when memory is short \
(list_skills() has the others).
4. launch_run(recipe={recipe}) as a short smoke run, then get_run(run_id): read its data summary \
(data: format, mask, loss_tokens, dropped) and set data.format or data.columns if they are not what \
the user meant. wait_run(run_id) until it ends, then tail_metrics(run_id): the loss must fall and \
not be nan.
5. resume_checkpoint(run_id, overrides={{"train.max_steps": N}}) or launch_run with \
overrides for the full run; wait_run(run_id) until it ends (call again on reason "timeout").
6. evaluate(run_id) for held-out loss and task metrics (note their sample count), \
sample(run_id, prompts) to read answers, and export_checkpoint(run_id, to={exported}) for a \
Hugging Face folder.
Stop and report the error text to the user if a step fails twice."""


def reinforce(
    model: Annotated[str, Field(description="A Hub id (org/name[@rev]) or a model folder in the workspace.")],
    data: Annotated[str, Field(description="Prompts: a data file or folder in the workspace, or a Hub data set id.")],
    reward: Annotated[str, Field(description="What earns reward, in words (e.g. 'the final number equals the answer column').")],
    name: Annotated[str, Field(description="The recipe's name (default: reinforce).")] = "reinforce",
) -> str:
    recipe, exported = _quoted(f"recipes/{name.strip()}"), _quoted(f"exports/{name.strip()}")
    model, data, reward, name = _quoted(model), _quoted(data), _quoted(reward), _quoted(name)
    return f"""Train {model} with reinforcement learning (GRPO) on the prompts of {data}, rewarded when {reward}:
1. describe_recipe(recipe="grpo"): read the grpo.* keys (num_generations, max_completion_length, loss_type, \
beta, reward_functions, reward_weights) and the data keys (data.prompt_column; every other column reaches the \
reward functions by name).
2. scaffold_recipe(template="grpo", name={name}, config={{"model.pretrained_path": {model}, \
"data.paths": [{data}], "train.max_steps": 20, "train.log_every": 2}}); for a Hub data set id use \
"data.dataset": {data} instead of data.paths.
3. Write the reward as code in {recipe}/recipe.py, beside the examples correct_answer and digits_only: a \
function of (prompts, completions, **columns) returning one float per completion (a completion is text, \
or a one-message list for chat prompts); commit it, and set grpo.reward_functions (and grpo.reward_weights) \
to name it. \
apply_skill(skill="lora", recipe={recipe}) for a model of more than ~100 M parameters.
4. launch_run(recipe={recipe}) as a short smoke run (the launch check refuses a missing prompt column, a \
reward function not defined, num_generations < 2 or a completion longer than data.seq_len allows), then \
wait_run(run_id) until it ends and tail_metrics(run_id): reward and reward_<function> must move; \
zero_signal_groups near 1 means every completion of a group scores the same (make the reward finer, or \
raise temperature or num_generations); truncated_frac near 1 means max_completion_length is too short.
5. resume_checkpoint(run_id, overrides={{"train.max_steps": N}}) or launch_run with overrides for the \
full run; wait_run(run_id) until it ends (call again on reason "timeout"); compare_runs(run_a, run_b) \
compares the reward of two runs.
6. evaluate(run_id) for the mean reward per function on held-out prompts (note the prompts count), \
sample(run_id, prompts) to read answers, and export_checkpoint(run_id, to={exported}).
Stop and report the error text to the user if a step fails twice."""


def speed_up(
    recipe: Annotated[str, Field(description="A recipe folder (recipes/lm) or your own training script (train.py).")],
) -> str:
    recipe = _quoted(recipe)
    return f"""Make {recipe} train faster on this machine, measured. It is a recipe, or your own training \
script (a .py file, or a folder with a train.py and no recipe.py): a script's runs take its command \
line as args=A (which sets its steps) wherever a recipe's take overrides=O; the rest is alike.
1. list_runs(), then get_run(run_id) of its latest run: note speed (mean tokens/s, step time), padding_frac, \
peak memory and warnings. No run yet: launch_run(recipe={recipe}, overrides={{"train.max_steps": 30}}) \
(a script: args=A for about 30 steps) and wait_run until it ends.
2. list_skills(): pick the ones the run's figures call for (padding_frac above 0.3: \
sequence-packing; a CUDA GPU: flash-attention, liger-kernel, mixed-precision; many steps of one \
shape: torch-compile). get_skill(skill) for each: its "When to use" must fit.
3. apply_skill(skill, recipe={recipe}, dry_run=true) to read the diff, then apply it (one commit \
per skill); note its commit C.
4. Measure each skill as an A/B, its commit against the one before it, with the same overrides O \
(the baseline's, with train.log_every a tenth of train.max_steps) or the same args A: \
launch_run(recipe={recipe}, overrides=O, commit="C^") (a: without it) and wait_run(run_id) until it ends; \
launch_run(recipe={recipe}, overrides=O, commit="C") (b: with it) and wait_run; then b again and a again, \
in that order, so that the machine's load falls on both. compare_runs(run_a, run_b) for each pair, \
first_step_s and wall_s (start-up, compilation) beside the step time: claim a gain only when both pairs \
say better for the run's length. (From a shell, `trainwright ab SKILL {recipe} --steps 30 --note`, for a \
script `trainwright ab SKILL {recipe} --note -- A`, runs the same A/B and writes its verdict into the \
skill commit's git note.)
5. Keep a skill that helped; for one that did not, say so to the user (git revert its commit)."""


def diagnose_run(
    run_id: Annotated[str, Field(description="The run to diagnose (list_runs has the ids).")],
) -> str:
    run_id = _quoted(run_id)
    return f"""Diagnose run {run_id} and say what to do next:
1. get_run(run_id={run_id}): status, error, warnings, the console's end when it failed.
2. Failed: read the error; a config error names the key (describe_recipe lists them), an \
out-of-memory error calls for gradient-checkpointing or a smaller data.batch_size; fix and \
launch_run again.
3. tail_metrics(run_id={run_id}, follow_resumes=true) and the resource run://<id>/loss.png: \
a loss that is nan or rises calls for a lower optim.lr (or the loss-guard skill); a loss that \
stays flat, a higher one or more steps.
4. Stopped or interrupted: list_checkpoints(run_id={run_id}), then resume_checkpoint(run_id, step).
5. Report the finding, the evidence (steps and values), and the one next call."""


WORKFLOWS = (finetune, reinforce, speed_up, diagnose_run)


def register_prompts(mcp: MCPServer) -> None:
    for workflow in WORKFLOWS:
        description = {
            "finetune": "Fine-tune a model on a data set: scaffold, skills, launch, wait, evaluate, export.",
            "reinforce": "Train a model with GRPO on prompts, rewards written as code: scaffold, reward, launch, evaluate, export.",
            "speed_up": "Make a recipe or script train faster: which skills fit this machine, applied and measured.",
            "diagnose_run": "Read a run's failure or loss curve and say the next step.",
        }[workflow.__name__]
        mcp.prompt(name=workflow.__name__, description=description)(workflow)


def _choices(ws: Workspace, argument: str) -> list[str]:
    import skills as skill_library  # here, not at the top: a server starts without them
    from mcp_server.operations import recipe_info
    from mcp_server.operations import recipes as recipe_ops

    if argument == "run_id":
        return sorted(ws.run_ids(), reverse=True)  # the newest first: ids start with their time
    if argument == "recipe":
        folders, _ = recipe_info.find_recipes(ws)
        return [str(folder.relative_to(ws.root)) for folder in folders]
    if argument == "template":
        return [t.name for t in recipe_ops.list_templates().templates]
    if argument in ("skill", "name"):
        return [card.name for card in skill_library.list_skill_cards()]
    return []


def register_completions(mcp: MCPServer, ws: Workspace) -> None:
    @mcp.completion()
    async def complete(ref: PromptReference | ResourceTemplateReference, argument: Any, context: Any) -> Completion:
        if isinstance(ref, PromptReference) and ref.name in ("finetune", "reinforce") and argument.name == "name":
            return Completion(values=[])  # a new recipe's name: nothing to complete from
        prefix = str(argument.value or "")
        # A name with control characters (a folder an agent made) is not offered: not echoed raw.
        values = [v for v in _choices(ws, str(argument.name)) if v.startswith(prefix) and v.isprintable()]
        return Completion(values=values[:MAX_COMPLETIONS], total=len(values),
                          has_more=len(values) > MAX_COMPLETIONS)
