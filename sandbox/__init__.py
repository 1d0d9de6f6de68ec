"""The workspace an agent acts on, and the guard rails around it.

- ``paths``        path confinement: every path or name a tool takes is checked here
- ``workspace``    the workspace: its root, recipes, runs
- ``git``          commits with trailers, notes on commits, dirty checks
- ``environment``  the allow-listed environment a run gets (no secrets)
- ``runs``         check, spawn and stop runs
- ``supervise``    the per-run supervisor process (``python -m sandbox.supervise RUN_DIR``)

Standard library and GitPython only: the MCP server imports this package.
"""
