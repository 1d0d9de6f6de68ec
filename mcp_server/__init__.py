"""The agent-facing side of trainwright.

- ``declarations`` every tool declared once: arguments, result, hints, operation
- ``arguments``    each tool's arguments model, and how the terminal spells a field
- ``operations/``  one function per tool, pydantic in and out (skills, recipes, runs)
- ``models``       the result models
- ``limits``       bounds on what a tool takes and returns
- ``server``       the MCP binding of the declarations (``trainwright serve``), resources
- ``tool_schemas`` each tool's JSON schemas: generated, compacted, kept on disk (a start's ``tools/list``)
- ``http_auth``    streamable HTTP with a bearer token (``serve --http``)
- ``stdio``        ``serve`` over stdio: the SDK's transport, answering a message whose number Python cannot read
- ``live``         live runs as resources: subscriptions and the poll of run directories
- ``tasks``        long calls as MCP tasks
- ``clients``      what the server keeps per client, and its log messages to it
- ``run_view``     the MCP App view of a run (``ui://trainwright/run``)
- ``workflows``    the workflows as MCP prompts, and completions of their arguments
- ``plot``         a run's loss curve as a PNG
- ``cli``          the ``trainwright`` command line, generated from the declarations
- ``following``    what the command line prints of a run as it goes, and its outcome as an exit code
- ``terminal``     how each tool's result reads in a terminal

This package never imports torch: the engine runs in separate processes.
"""
