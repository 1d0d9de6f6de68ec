"""The operations behind the MCP tools and the CLI commands: one function per tool.

An operation takes the values its tool's arguments model (:mod:`mcp_server.arguments`) validated:
types, bounds and choices are checked there, once, by the MCP binding and the CLI alike. An
operation checks only what needs the workspace (names, paths, runs, recipes, git). A Python
caller with values from elsewhere validates them first (``TailArgs.checked(run_id=..., n=...)``).

- ``skills``       list, show, apply a skill (one reviewable commit)
- ``recipes``      list templates, scaffold a recipe from one
- ``recipe_info``  a recipe's config keys, the workspace's recipes
- ``launch``       start a run: every way (recipe, commit, script, resume, joining node, SLURM
                   job) is a ``Launch``, checked into a plan by one pipeline, then started
- ``starting_model`` a recipe launch from an earlier run's checkpoint (``run:ID@STEP``), exported once
- ``runs``         read runs: list, inspect, tail, stop, list checkpoints; a launch's result
- ``waiting``      wait until a run reaches a step or ends
- ``history``      a run's history across resumes, as one metrics series
- ``estimate``     a run's memory and step time before it starts
- ``compare``      what differs between two runs, judged at their noise
- ``ab``           ``trainwright ab``: a skill's commit against its parent, measured
- ``model_tools``  export, sample, evaluate a checkpoint
- ``push``         export a checkpoint to the Hub (``to="hub:org/name"``), evaluated, with its card
- ``model_card``   the model card of a push, from the server's record of the run
- ``review``       ``trainwright review``: what the agent changed and what it produced
- ``data_cache``   ``trainwright data-cache``: the tokenized data runs share, sizes, removal
"""
