"""The torch-free launcher of a one-node run's ranks (``runner.local_ranks``): torchrun's
variables in each rank, a failing rank ending the run with its status, a signal reaching every
rank. The ranks here are small Python programs (no torch): what is tested is the launcher."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from engine.run_dir import pid_alive
from runner.local_ranks import launcher_command
from tests.support import REPO, wait_for

VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

# Each rank prints its variables and whether its parent, the launcher, has torch's library mapped.
REPORT = (
    "import json, os\n"
    f"report = {{k: os.environ[k] for k in {VARIABLES!r}}}\n"
    "report['launcher_maps_torch'] = 'libtorch' in open(f'/proc/{os.getppid()}/maps').read()\n"
    "os.write(1, (json.dumps(report) + '\\n').encode())  # one write: the ranks' lines do not interleave\n"
)

# Rank ``FAILING`` exits with status 3 once every rank has written its pid; the others sleep.
SLEEP_OR_FAIL = (
    "import os, sys, time\n"
    "from pathlib import Path\n"
    "folder = Path(sys.argv[1])\n"
    "(folder / os.environ['RANK']).write_text(str(os.getpid()))\n"
    "while len(list(folder.iterdir())) < int(os.environ['WORLD_SIZE']):\n"
    "    time.sleep(0.02)\n"
    "if os.environ['RANK'] == os.environ.get('FAILING'):\n"
    "    sys.exit(3)\n"
    "time.sleep(600)\n"
)


def launch(nproc: int, *python_args: str, **popen) -> subprocess.Popen:
    return subprocess.Popen([*launcher_command(nproc), *python_args], cwd=REPO, **popen)


def rank_pids(folder: Path, nproc: int) -> list[int]:
    wait_for(lambda: len(list(folder.iterdir())) == nproc, timeout=60)
    return [int((folder / str(rank)).read_text()) for rank in range(nproc)]


def test_each_rank_gets_torchruns_variables_and_one_free_port_from_a_launcher_without_torch():
    result = subprocess.run([*launcher_command(3), "-c", REPORT], cwd=REPO, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    reports = sorted((json.loads(line) for line in result.stdout.splitlines()), key=lambda r: r["RANK"])
    port = reports[0]["MASTER_PORT"]
    assert port.isdigit() and 0 < int(port) < 65536
    assert reports == [
        {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "3", "LOCAL_WORLD_SIZE": "3",
         "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "launcher_maps_torch": False}
        for rank in range(3)
    ]


def test_a_failing_rank_ends_the_others_and_the_launcher_exits_with_its_status(tmp_path):
    process = launch(3, "-c", SLEEP_OR_FAIL, str(tmp_path), env={**os.environ, "FAILING": "1"},
                     stderr=subprocess.PIPE, text=True)
    pids = rank_pids(tmp_path, 3)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 3
    assert f"[trainwright] rank 1 (pid {pids[1]}) exited with status 3; ending the other 2 rank(s)" in stderr
    assert not [pid for pid in pids if pid_alive(pid)]


def test_sigterm_to_the_launcher_reaches_every_rank_and_it_exits_when_they_have(tmp_path):
    process = launch(2, "-c", SLEEP_OR_FAIL, str(tmp_path), start_new_session=True)
    pids = rank_pids(tmp_path, 2)
    time.sleep(0.2)  # its handlers are set before the ranks start; let them sleep
    os.kill(process.pid, signal.SIGTERM)  # the launcher alone, not its group
    assert process.wait(timeout=30) == 128 + signal.SIGTERM
    assert not [pid for pid in pids if pid_alive(pid)]


def test_a_launch_without_a_count_or_a_program_is_refused_with_its_usage():
    result = subprocess.run([sys.executable, "-m", "runner.local_ranks", "--nproc-per-node", "0", "-c", "pass"],
                            cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "usage: python -m runner.local_ranks --nproc-per-node N" in result.stderr
