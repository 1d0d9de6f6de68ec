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


# Each rank: whether it holds the store's socket, listening on MASTER_PORT, under the variable.
STORE_REPORT = (
    "import json, os, socket\n"
    "fd = os.environ.get('TRAINWRIGHT_STORE_FD')\n"
    "port = None\n"
    "if fd:\n"
    "    s = socket.socket(fileno=int(fd))\n"
    "    port = s.getsockname()[1] if s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) else None\n"
    "    s.detach()\n"
    "report = {'RANK': os.environ['RANK'], 'MASTER_PORT': os.environ['MASTER_PORT'], 'listening_on': port,\n"
    "          'fd': fd}\n"
    "os.write(1, (json.dumps(report) + '\\n').encode())\n"
)

# A gloo world formed as the engine forms it (rank 0 serves the store on the handed socket).
WORLD = (
    "import os, torch, torch.distributed as dist\n"
    "from engine.distributed import own_store\n"
    "rank, world = int(os.environ['RANK']), int(os.environ['WORLD_SIZE'])\n"
    "dist.init_process_group('gloo', rank=rank, world_size=world, store=own_store(rank, world))\n"
    "t = torch.tensor([rank + 1.0]); dist.all_reduce(t)\n"
    "os.write(1, f\"{int(t.item())} {'TRAINWRIGHT_STORE_FD' in os.environ}\\n\".encode())  # one write a rank\n"
    "dist.destroy_process_group()\n"
)


def test_rank_0_alone_inherits_the_store_socket_already_listening_on_master_port():
    result = subprocess.run([*launcher_command(3), "-c", STORE_REPORT], cwd=REPO, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    reports = sorted((json.loads(line) for line in result.stdout.splitlines()), key=lambda r: r["RANK"])
    assert reports[0]["listening_on"] == int(reports[0]["MASTER_PORT"])
    assert [(r["listening_on"], r["fd"]) for r in reports[1:]] == [(None, ""), (None, "")]  # they join by address


def test_the_ranks_form_their_world_on_the_handed_socket():
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    result = subprocess.run([*launcher_command(3), "-c", WORLD], cwd=REPO, capture_output=True, text=True,
                            timeout=120, env={**env, "PYTHONPATH": str(REPO)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["6", "False"] * 3  # 1 + 2 + 3 on every rank; the variable consumed


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
