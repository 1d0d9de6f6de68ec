"""How the OpenMP threads of a training process wait for work (torch-free; set before torch loads).

torch's CPU kernels run on an OpenMP team (libgomp in the CPU wheels) of ``OMP_NUM_THREADS``
threads. Between parallel regions libgomp's threads spin by default (300,000 iterations)
rather than sleep, unless it counts more of its own threads than CPUs; then it spins 1,000
times only. A run's team is sized to the cores it has, so libgomp never throttles by that
count alone, and on a machine where anything else computes (other runs, tests, the next
training job) a spinning thread takes the core its partner needs to finish the region: each
step costs about 3x the user CPU time and runs at a fifth of its speed. The first checkpoint
used to end it by a side effect: the save runs tensor copies on a gloo worker thread, whose
second OpenMP team stays alive, libgomp then counts more threads than CPUs and throttles its
spinning from then on.

So every engine process, and every process of a run (:func:`sandbox.environment.run_environment`),
starts with ``OMP_WAIT_POLICY=PASSIVE``: a waiting thread sleeps at once. Losses are unchanged
(the policy decides how threads wait, not how work is split). A policy or a spin count the
user's environment sets (``OMP_WAIT_POLICY``, ``GOMP_SPINCOUNT``) is kept.

libgomp reads these variables once, when it is loaded: they must be in the environment before
torch is imported (``engine.launch`` and ``engine.model_io`` call :func:`apply_wait_policy`
first).
"""

from __future__ import annotations

import os
from typing import MutableMapping

WAIT_POLICY_VARIABLE = "OMP_WAIT_POLICY"
SPIN_COUNT_VARIABLE = "GOMP_SPINCOUNT"
WAIT_POLICY = "PASSIVE"


def apply_wait_policy(environ: MutableMapping[str, str] | None = None) -> None:
    """Set ``OMP_WAIT_POLICY=PASSIVE`` in ``environ`` (default: this process's) unless the
    user chose how OpenMP threads wait."""
    environ = os.environ if environ is None else environ
    if WAIT_POLICY_VARIABLE not in environ and SPIN_COUNT_VARIABLE not in environ:
        environ[WAIT_POLICY_VARIABLE] = WAIT_POLICY
