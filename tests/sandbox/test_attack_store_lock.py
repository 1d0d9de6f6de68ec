"""Attack: a run that takes a data store's lock and never builds the store must not keep the
runs of the same data waiting for ever, however it makes its hold look like a build."""

from __future__ import annotations

import fcntl
import os
import threading
import time
from pathlib import Path

import pytest

from engine import store_lock, token_store
from engine.config import ConfigError
from engine.data_files import STORE_LOCK_SUFFIX

KEY = "f" * 32


@pytest.fixture
def quick(monkeypatch):
    monkeypatch.setattr(store_lock, "LOCK_STALL_S", 0.6)
    monkeypatch.setattr(store_lock, "WAIT_POLL_S", 0.05)
    monkeypatch.setattr(store_lock, "MIN_BUILD_BYTES_PER_S", 1000)  # 600 bytes of data: 0.6 s more
    monkeypatch.setenv(store_lock.RUN_ID_VARIABLE, "lm-20261205-hostile")


def hold(cache: Path, stop: threading.Event, held: threading.Event, writes: bool, swaps: bool) -> None:
    """A hostile run's hold of the store's lock for 6 s (or until ``stop``): writing into a real
    build folder every 0.1 s, or swapping the lock's file for a fresh one it holds every 0.2 s."""
    name, build = cache / f"{KEY}{STORE_LOCK_SUFFIX}", cache / f"{KEY}.building-x"
    build.mkdir()
    fd = os.open(name, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, b"run lm-20261205-hostile")
    held.set()
    end = time.monotonic() + 6
    while time.monotonic() < end and not stop.wait(0.1 if writes else 0.2):
        if writes:
            with open(build / "train.bin", "ab") as f:
                f.write(b"x")
        if swaps:
            os.unlink(name)
            fresh = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            fcntl.flock(fresh, fcntl.LOCK_EX)
            os.write(fresh, b"run lm-20261205-hostile")
            os.close(fd)  # the waiter gets the old file's lock, finds it no longer the lock's, tries again
            fd = fresh
    stop.wait(10)
    os.close(fd)


def waited_for(cache: Path, writes: bool, swaps: bool, input_bytes: int) -> tuple[str, float]:
    stop, held = threading.Event(), threading.Event()
    holder = threading.Thread(target=hold, args=(cache, stop, held, writes, swaps))
    holder.start()
    held.wait(10)
    start = time.monotonic()
    try:
        with pytest.raises(ConfigError) as refused:  # as a run's builder of that data waits
            token_store.open_or_build(KEY, 1, "uint16", lambda writer: {}, input_bytes=input_bytes, root=cache)
        return str(refused.value), time.monotonic() - start
    finally:
        stop.set()
        holder.join()


def test_a_run_that_writes_into_its_build_for_ever_is_given_up_on_after_the_datas_longest_build(tmp_path, quick):
    """The holder's build folder grew every 0.1 s, so a waiter took it for a build going on: it
    waited as long as the holder kept writing (for ever)."""
    message, waited = waited_for(tmp_path, writes=True, swaps=False, input_bytes=600)
    assert message == (f"the data cache's store {KEY} is locked by run lm-20261205-hostile, which has held it for over "
                       "1 s, longer than building 0.0 MB of data takes at 1 KB/s; stop that run, or launch again once "
                       "it has ended")
    assert 1.2 <= waited < 3
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{KEY}.building-x", f"{KEY}.lock"]  # the holder's alone


def test_a_run_that_swaps_the_locks_file_does_not_restart_the_waiters_patience(tmp_path, quick):
    """Each fresh lock file started the waiter's stall clock again: a holder that swapped it
    within 120 s, writing nothing, kept the others waiting for ever."""
    message, waited = waited_for(tmp_path, writes=False, swaps=True, input_bytes=0)
    assert message == (f"the data cache's store {KEY} is locked by run lm-20261205-hostile, which has written nothing "
                       "of it for 1 s; stop that run, or launch again once it has ended")
    assert 0.6 <= waited < 3


def test_an_honest_build_within_the_datas_longest_build_is_waited_for(tmp_path, quick):
    # 3,000 bytes of data: 0.6 + 3 s; the holder builds for about 1.2 s, then publishes and lets go.
    held = threading.Event()

    def build() -> None:
        with store_lock.locked_store(tmp_path, KEY, input_bytes=3000):
            held.set()
            (tmp_path / f"{KEY}.building-x").mkdir()
            for _ in range(12):
                with open(tmp_path / f"{KEY}.building-x" / "train.bin", "ab") as f:
                    f.write(b"x")
                time.sleep(0.1)

    holder = threading.Thread(target=build)
    holder.start()
    held.wait(10)
    start = time.monotonic()
    with store_lock.locked_store(tmp_path, KEY, input_bytes=3000):
        assert time.monotonic() - start >= 1.0
    holder.join()


@pytest.mark.parametrize("waiter", ["this run's other rank", "a run of data with a Hub data set"])
def test_a_build_past_the_bound_is_waited_for_by_its_own_ranks_and_for_data_of_unknown_size(tmp_path, quick, waiter,
                                                                                             monkeypatch):
    # 600 bytes of data: 1.2 s at most by the bound; the build writes for 2 s, then publishes.
    held = threading.Event()

    def slow_build(writer: token_store.StoreWriter) -> dict:
        held.set()
        with writer.new_file("progress") as progress:
            for _ in range(20):
                progress.write(b"x")
                progress.flush()
                time.sleep(0.1)
        writer.add("train", [1, 2])
        return {"documents": 1}

    builder = threading.Thread(target=token_store.open_or_build, args=(KEY, 1, "uint16", slow_build, 600, tmp_path))
    builder.start()
    held.wait(10)
    if waiter == "this run's other rank":
        monkeypatch.setenv("LOCAL_RANK", "1")
    start = time.monotonic()
    store = token_store.open_or_build(KEY, 1, "uint16", lambda writer: {}, 600, tmp_path,
                                      whole_size=waiter == "this run's other rank")
    builder.join()
    assert time.monotonic() - start >= 1.5 and store.counts == {"documents": 1}
