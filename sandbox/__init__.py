"""Containment: what a process that runs recipe code can see, reach and show.

- ``bwrap``        the bubblewrap sandbox of every process that runs recipe code
- ``contained``    a command of recipe code run to its end in the sandbox, its output bounded
- ``network``      a network namespace with only loopback (the fallback without bubblewrap)
- ``environment``  the allow-listed environment a run gets (no secrets), its thread count
- ``redact``       the one sanitiser of shown text: secrets by value, control characters

Standard library only: the MCP server imports this package.
"""
