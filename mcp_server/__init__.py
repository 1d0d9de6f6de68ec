"""The agent-facing side of trainwright.

- ``operations/``  one function per tool, pydantic in and out (skills, recipes, runs)
- ``models``       the result models
- ``server``       the MCP binding (``trainwright serve``)
- ``workflows``    the workflows as MCP prompts, and completions of their arguments
- ``cli``          the ``trainwright`` command line, a twin of every tool

This package never imports torch: the engine runs in separate processes.
"""
