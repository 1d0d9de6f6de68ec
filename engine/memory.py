"""Peak memory of a training process: the one definition that metrics, estimates and
comparisons read.

Each process measures its own high-water marks (:func:`process_peaks`): the CPU resident set's
(``VmHWM`` of ``/proc/self/status``: the peak of this program since it was executed; where
there is no such file, ``ru_maxrss`` of ``getrusage``) and, on a GPU, CUDA's largest allocated
and reserved bytes. The engine gathers them from every rank into each training record
(``MetricRecord.rss_peak_mb`` and the ``cuda_*`` lists, in rank order) and ``peak_mem_mb`` is
the busiest process's figure of the device it trains on (:func:`busiest_peak_mb`).

On a CPU the resident set counts what the allocator holds, not what tensors hold: glibc's
default mmap threshold rises with each large block freed (up to 32 MiB), after which freed
activations stay in its heap and the resident set keeps them (a LoRA run at 1,024 tokens:
1,117 MB against 791 MB of live bytes and floor, bench/estimate_memory.py). With
``TRAINWRIGHT_MMAP_THRESHOLD=BYTES`` a CPU run (and the launch check that estimates one) fixes the
threshold at start (:func:`follow_live_memory`): a tensor of at least that size is mapped on its
own and given back when freed, and the peak resident set follows the live bytes (as
``max_memory_allocated`` does on a GPU). Not the default: every such tensor is then mapped and
faulted in afresh, and on the causal_lm template's model a step took 1.2–1.5× the CPU time at
256 KiB (bench/malloc_threshold.py). ``malloc_trim(0)`` does not take its place: called after each
forward it gave back 80 of the 338 MB kept (llama + lora at 1,024 tokens), at each step's start and
after backward 40, since the peak is reached inside a step. So by default a CPU estimate counts what
the heap keeps (:func:`heap_keeps_freed_memory`, ``engine.estimate.HEAP_KEPT``,
``HEAP_KEPT_CHECKPOINTED``).
"""

from __future__ import annotations

import ctypes
import os
import resource
from dataclasses import dataclass

import torch

from engine.distributed import DistInfo, all_gather_floats


@dataclass
class ProcessPeaks:
    """One process's high-water marks, in MiB."""

    rss_mb: float
    cuda_allocated_mb: float | None = None
    cuda_reserved_mb: float | None = None


MMAP_THRESHOLD_VARIABLE = "TRAINWRIGHT_MMAP_THRESHOLD"  # bytes; unset or 0: glibc's dynamic default
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)


def follow_live_memory(environ: dict[str, str] | None = None) -> int | None:
    """Fix glibc's mmap threshold for this process at ``TRAINWRIGHT_MMAP_THRESHOLD`` bytes (see
    the module docstring); returns the threshold set, or None where nothing was set: the variable
    unset or 0, glibc's own ``MALLOC_MMAP_THRESHOLD_`` given (already applied), another C library."""
    environ = os.environ if environ is None else environ
    raw = environ.get(MMAP_THRESHOLD_VARIABLE, "0")
    try:
        threshold = int(raw)
    except ValueError:
        raise ValueError(f"{MMAP_THRESHOLD_VARIABLE}={raw!r}: give a number of bytes (0: glibc's default)") from None
    if threshold <= 0 or "MALLOC_MMAP_THRESHOLD_" in environ:
        return None
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): its allocator as it is
        return None
    return threshold if mallopt(M_MMAP_THRESHOLD, threshold) == 1 else None


def heap_keeps_freed_memory(environ: dict[str, str] | None = None) -> bool:
    """Whether a CPU process started with ``environ`` keeps glibc's dynamic mmap threshold (no
    ``TRAINWRIGHT_MMAP_THRESHOLD``, no ``MALLOC_MMAP_THRESHOLD_``): then the resident set keeps
    freed activations (the module docstring), and a CPU estimate counts them
    (``engine.estimate.estimate_memory``)."""
    environ = os.environ if environ is None else environ
    fixed = environ.get(MMAP_THRESHOLD_VARIABLE, "0").strip() not in ("", "0")
    return not fixed and "MALLOC_MMAP_THRESHOLD_" not in environ


def rss_high_water_mb(status_path: str = "/proc/self/status") -> float:
    """The peak resident memory of this process (MiB) since it was executed."""
    try:
        with open(status_path) as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    # Linux reports ru_maxrss in KiB (it may carry a peak over from before an exec).
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def process_peaks(device: torch.device) -> ProcessPeaks:
    peaks = ProcessPeaks(rss_mb=rss_high_water_mb())
    if device.type == "cuda":
        peaks.cuda_allocated_mb = torch.cuda.max_memory_allocated(device) / 2**20
        peaks.cuda_reserved_mb = torch.cuda.max_memory_reserved(device) / 2**20
    return peaks


def gathered_peaks(device: torch.device, info: DistInfo) -> dict[str, list[float]]:
    """Every rank's peaks, as the record's per-process lists (rank order)."""
    own = process_peaks(device)
    values = [own.rss_mb]
    if own.cuda_allocated_mb is not None and own.cuda_reserved_mb is not None:
        values += [own.cuda_allocated_mb, own.cuda_reserved_mb]
    per_rank = all_gather_floats(values, info)
    lists = {"rss_peak_mb": [round(rank[0], 1) for rank in per_rank]}
    if len(values) == 3:
        lists["cuda_max_allocated_mb"] = [round(rank[1], 1) for rank in per_rank]
        lists["cuda_max_reserved_mb"] = [round(rank[2], 1) for rank in per_rank]
    return lists


def busiest_peak_mb(peaks: dict[str, list[float]]) -> float:
    """``peak_mem_mb``: the largest process's peak on the device it trains on (CUDA allocated
    on a GPU, the resident set on a CPU)."""
    return max(peaks.get("cuda_max_allocated_mb") or peaks["rss_peak_mb"])
