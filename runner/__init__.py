"""Runs outside the engine: checked, started under a supervisor, followed and stopped.

- ``lifecycle``    the launch check, ``LaunchPlan`` and ``start_run``, ``stop_run``
- ``capacity``     the workspace's caps on concurrent runs and processes, checked before a launch
- ``server_record`` the server's own record of a run, written by the server and the supervisor
- ``supervise``    the per-run supervisor process (``python -m runner.supervise RECORD_DIR``)
- ``processes``    every process of a run, found, signalled and ended together; recipe code run outside a run
- ``provenance``   the code snapshot a run executes, and where that code came from
- ``hub``          models and data sets by Hub id: downloaded by the server, bound read-only
- ``hub_push``     a push to the Hub: its target, the server's token (never in a sandbox), the upload
- ``scripts``      runs of the user's own training script: command, arguments, metrics lines
- ``tensorboard_events`` a script's TensorBoard scalars, read as its metrics
- ``nodes``        runs over several nodes: c10d rendezvous settings
- ``local_ranks``  the ranks of a one-node run, started without torch (``python -m runner.local_ranks``)
- ``slurm``        runs as SLURM jobs: the job script, sbatch, squeue/sacct, scancel
- ``model_process`` the sandboxed process that exports, samples or evaluates a checkpoint
- ``task_data``    the Hub data sets lm-eval task YAMLs name, found in the server's cache for ``evaluate``

Standard library, GitPython and pydantic only: the MCP server imports this package; the
engine runs in the processes it starts.
"""
