"""``python -m tests.sandbox.forged_record_probe WORKDIR PID CHILD_PGID``: run under
``unshare --pid --fork --mount-proc`` by tests/sandbox/test_attack_forged_run_record.py, so that
a broadcast signal reaches only this PID namespace.

It starts a bystander (a process that is not the run's), a supervised run, rewrites the run's
run.json as the run's code could (``pid`` and ``child_pgid`` as given, ``null`` for None), calls
``stop_run`` and prints one JSON line: whether the bystander survived and the run's status.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from engine import run_dir as rd
from engine import run_files
from mcp_server.operations import runs as run_ops
from workspace.workspace import Workspace
from tests.sandbox.helpers import make_workspace, supervise
from tests.support import wait_for

RUN_ID = "20260101-000000-forged-0000"


def main(workdir: str, pid: str, child_pgid: str) -> int:
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    workspace = make_workspace(Path(workdir) / "ws")
    run_dir = workspace / rd.RUNS_DIRNAME / RUN_ID
    supervise(run_dir, [sys.executable, "-c", "print('STARTED', flush=True); import time; time.sleep(600)"],
              {"stop_grace_s": 1}, run_id=RUN_ID)
    wait_for(lambda: "STARTED" in (run_dir / rd.CONSOLE_LOG).read_text(), timeout=60)
    forged = {"pid": None if pid == "null" else int(pid), "child_pgid": None if child_pgid == "null" else int(child_pgid)}
    run_files.write_json_atomic(run_dir / rd.RUN_JSON, {**json.loads((run_dir / rd.RUN_JSON).read_text()), **forged,
                                                  "status": rd.RUNNING})
    error = None
    try:
        status = run_ops.stop_run(Workspace.open(workspace), RUN_ID).status
    except Exception as e:  # noqa: BLE001 — reported to the test
        status, error = None, f"{type(e).__name__}: {e}"
    time.sleep(0.5)
    survived = bystander.poll() is None
    bystander.kill()
    print("PROBE " + json.dumps({"bystander_survived": survived, "status": status, "error": error}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
