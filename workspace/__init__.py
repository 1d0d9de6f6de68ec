"""The workspace an agent acts on: its folder, its git history, its settings and audit log.

- ``paths``        path confinement: every path or name a tool takes is checked here
- ``workspace``    the workspace: its root, recipes, runs, change lock, run limits
- ``settings``     the trusted settings (outside the workspace): the limits and containment of runs
- ``files``        atomic writes, and files put back as they were when a change fails
- ``git``          commits with trailers (a change written and committed, or put back), notes, dirty checks
- ``audit``        the audit log of every tool call

Standard library, GitPython and PyYAML only: the MCP server imports this package.
"""
