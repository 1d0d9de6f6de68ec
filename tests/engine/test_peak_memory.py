"""The one definition of a process's peak memory (engine/memory.py)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from engine.memory import MMAP_THRESHOLD_VARIABLE, busiest_peak_mb, follow_live_memory, rss_high_water_mb

REPO = Path(__file__).resolve().parents[2]
# Frees 64 blocks of 1 MiB below a block of 200 KiB that stays (the heap cannot be trimmed), after a
# freed 16 MiB block raised glibc's dynamic threshold; prints the resident MiB the frees gave back.
FREES = """
import ctypes, sys
from engine.memory import follow_live_memory
set_to = follow_live_memory()
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
def rss():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS:")) / 1024
libc.free(libc.malloc(16 << 20))
blocks = [libc.malloc(1 << 20) for _ in range(64)]
for block in blocks:
    ctypes.memset(block, 1, 1 << 20)
pinned = libc.malloc(200 << 10)
ctypes.memset(pinned, 1, 200 << 10)
before = rss()
for block in blocks:
    libc.free(block)
print(set_to, round(before - rss()))
"""


def test_the_resident_high_water_mark_is_vmhwm_in_mib(tmp_path: Path):
    status = tmp_path / "status"
    status.write_text("Name:\tpython\nVmPeak:\t 9000000 kB\nVmHWM:\t  524288 kB\nVmRSS:\t  100 kB\n")
    assert rss_high_water_mb(str(status)) == 512.0


def test_without_proc_the_high_water_mark_comes_from_getrusage(tmp_path: Path):
    assert rss_high_water_mb(str(tmp_path / "missing")) > 10  # this interpreter, at least


def test_the_busiest_peak_is_cuda_allocated_on_a_gpu_and_rss_on_a_cpu():
    assert busiest_peak_mb({"rss_peak_mb": [700.0, 900.0]}) == 900.0
    on_gpu = {"rss_peak_mb": [3000.0, 3100.0], "cuda_max_allocated_mb": [2000.0, 2500.0],
              "cuda_max_reserved_mb": [2600.0, 2700.0]}
    assert busiest_peak_mb(on_gpu) == 2500.0


def freed_back(**variables: str) -> tuple[str, int]:
    env = {k: v for k, v in os.environ.items() if k not in ("MALLOC_MMAP_THRESHOLD_", MMAP_THRESHOLD_VARIABLE)}
    done = subprocess.run([sys.executable, "-c", FREES], env={**env, **variables, "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=120, check=True)
    threshold, given_back = done.stdout.split()
    return threshold, int(given_back)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mmap threshold")
def test_with_the_threshold_fixed_freed_blocks_leave_the_resident_set():
    threshold, given_back = freed_back(**{MMAP_THRESHOLD_VARIABLE: str(256 * 1024)})
    assert threshold == str(256 * 1024) and given_back >= 60
    # glibc's dynamic default (the variable unset) keeps them in its heap, counted in the resident set
    threshold, given_back = freed_back()
    assert threshold == "None" and given_back < 8


def test_the_threshold_is_left_to_glibc_where_asked_and_a_bad_value_is_named():
    assert follow_live_memory({}) is None
    assert follow_live_memory({MMAP_THRESHOLD_VARIABLE: "0"}) is None
    assert follow_live_memory({MMAP_THRESHOLD_VARIABLE: "262144", "MALLOC_MMAP_THRESHOLD_": "131072"}) is None
    with pytest.raises(ValueError, match=f"{MMAP_THRESHOLD_VARIABLE}='lots'"):
        follow_live_memory({MMAP_THRESHOLD_VARIABLE: "lots"})
