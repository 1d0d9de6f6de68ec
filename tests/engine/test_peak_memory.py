"""The one definition of a process's peak memory (engine/memory.py)."""

from __future__ import annotations

from pathlib import Path

from engine.memory import busiest_peak_mb, rss_high_water_mb


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
