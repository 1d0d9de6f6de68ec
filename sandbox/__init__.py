"""The workspace an agent acts on, and the guard rails around it.

- ``paths``        path confinement: every path or name a tool takes is checked here
- ``workspace``    the workspace: its root, recipes, runs, change lock, run limits
- ``config``       ``.trainwright/config.yaml``: the limits and containment of runs
- ``git``          commits with trailers, notes on commits, dirty checks
- ``environment``  the allow-listed environment a run gets (no secrets), its thread count
- ``bwrap``        the bubblewrap sandbox of every process that runs recipe code
- ``network``      a network namespace with only loopback (the fallback without bubblewrap)
- ``processes``    every process of a run, found and ended together
- ``runs``         check, spawn and stop runs
- ``supervise``    the per-run supervisor process (``python -m sandbox.supervise RECORD_DIR``)
- ``scripts``      runs of the user's own training script: command, arguments, metrics lines
- ``tensorboard_events`` a script's TensorBoard scalars, read as its metrics
- ``audit``        the audit log of every tool call

Standard library, GitPython and PyYAML only: the MCP server imports this package.
"""
