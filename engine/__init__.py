"""The trainwright training engine.

Small and explicit, one concept per file:

- ``launch``          the entry point: ``python -m engine.launch RECIPE_DIR [--set key=value ...]``
- ``config``          the base configuration models and the ``--set`` / YAML layering
- ``distributed``     process group, device and the (dp, tp) device mesh
- ``blocks``          ``find_blocks``: a model's repeated blocks (FSDP2's and every skill's)
- ``fsdp``            FSDP2 ``fully_shard`` per transformer block and on the root
- ``grad_clip``       gradient clipping that works across DTensor meshes
- ``checkpoint``      DCP checkpoints that are published atomically
- ``engine``          the ``Engine`` base class: lifecycle and training loop
- ``metrics``         the aggregating metric logger and its backends
- ``flops``           model FLOPs per token and MFU
- ``run_dir``         the on-disk run directory format (torch-free; the server reads it)

Importing this package must not import torch: the MCP server imports ``engine.run_dir``.
"""
