"""A data store's lock: the first process to need a store builds it while holding ``<key>.lock``
in the cache folder (runs of other data never wait for it), with its holder's name written in
it; whoever else needs the store waits, and gives up naming the holder when that holder's build
stalls or outlasts any honest build of the data (:class:`LockWait`). The lock itself (a file
opened following no link, ``flock``): :func:`engine.data_files.holding_store_lock`.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import math
import os
import re
import time
from pathlib import Path

from engine.config import ConfigError
from engine.data_files import DATA_CACHE_VARIABLE as CACHE_VARIABLE
from engine.data_files import holding_store_lock
from engine.run_dir import RUN_ID_VARIABLE

WAIT_POLL_S = 0.5  # how often a rank that does not build looks for the store
# A store's lock held this long while its build writes nothing: whoever waits for it gives up,
# naming the holder (a run that took the lock and builds nothing must not stop other runs for ever).
LOCK_STALL_S = 120.0
# A waiter that knows the data's size gives up once it has waited LOCK_STALL_S plus those bytes at this
# pace (bytes a second, 50 times below the 1-10 MB/s builds run at), however the holder's build writes.
MIN_BUILD_BYTES_PER_S = 20_000
MAX_HOLDER_CHARS = 120
_PRINTABLE = re.compile(r"[^ -~]")  # the holder's name, as its holder wrote it: printable ASCII only


@contextlib.contextmanager
def locked_store(root: Path, key: str, wait: bool = True, input_bytes: int = 0):
    """The lock of the store ``key`` (``<key>.lock`` in the cache folder: a build of other data
    never waits for it), held while the store is looked up and built, with its holder's name (its
    run) written in it. A waiter gives up with :class:`ConfigError` naming the holder when the
    holder's build of the store writes nothing for :data:`LOCK_STALL_S` (a run that holds the lock
    and builds nothing), or, given the size of the data (``input_bytes``, the same for every
    holder of the key), once it has waited longer than a build of it takes at
    :data:`MIN_BUILD_BYTES_PER_S` (a run that holds the lock and writes for ever); a holder that
    swaps the lock's file resets neither. ``wait=False`` raises ``BlockingIOError`` at once when
    it is held. A link in the cache folder's place is refused (the lock would be another folder's)."""
    try:
        cache_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as e:
        if e.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        raise ConfigError(f"the data cache {root} is a symbolic link or not a folder; remove it, or set "
                          f"{CACHE_VARIABLE} to a folder") from None
    try:
        waiting = LockWait(root, key, wait, input_bytes)
        with holding_store_lock(cache_fd, key, waiting.acquire) as fd:
            os.ftruncate(fd, 0)
            os.pwrite(fd, lock_holder().encode(), 0)
            yield
    finally:
        os.close(cache_fd)


def lock_holder() -> str:
    """How a store's lock names this process: its run, else its pid."""
    run = os.environ.get(RUN_ID_VARIABLE)
    return f"run {run}" if run else f"process {os.getpid()} (not a run)"


class LockWait:
    """One waiter's wait for a store's lock, over every lock file it tries: when it started, and
    when the holder's build last wrote (a holder that swaps the lock's file resets neither)."""

    def __init__(self, root: Path, key: str, wait: bool, input_bytes: int):
        self.root, self.key, self.wait = root, key, wait
        self.longest = LOCK_STALL_S + input_bytes / MIN_BUILD_BYTES_PER_S if input_bytes > 0 else math.inf
        self.input_bytes, self.written, self.started = input_bytes, -1, time.monotonic()
        self.since = self.started

    def acquire(self, fd: int) -> None:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if not self.wait:
                    raise
            now, building = time.monotonic(), building_bytes(self.root, self.key)
            if building != self.written:
                self.written, self.since = building, now
            elif now - self.since > LOCK_STALL_S:
                raise ConfigError(f"the data cache's store {self.key} is locked by {self.holder(fd)}, which has written "
                                  f"nothing of it for {LOCK_STALL_S:.0f} s; stop that run, or launch again once it "
                                  "has ended")
            if now - self.started > self.longest:
                raise ConfigError(f"the data cache's store {self.key} is locked by {self.holder(fd)}, which has held it "
                                  f"for over {self.longest:.0f} s, longer than building {self.input_bytes / 1e6:.1f} MB "
                                  f"of data takes at {MIN_BUILD_BYTES_PER_S / 1e3:.0f} KB/s; stop that run, or launch "
                                  "again once it has ended")
            time.sleep(WAIT_POLL_S)

    @staticmethod
    def holder(fd: int) -> str:  # as the holder wrote it into the lock's file: printable ASCII, bounded
        return _PRINTABLE.sub("?", os.pread(fd, MAX_HOLDER_CHARS, 0).decode(errors="replace")) or "another process"


def building_bytes(root: Path, key: str) -> int:
    """The bytes written so far into the builds of ``key`` (``<key>.building-*``, parts included):
    what a waiter watches grow. A link in a build's place is none (a run planted it)."""
    total = 0
    for building in root.glob(f"{key}.building-*"):
        if building.is_symlink():
            continue
        for folder, _, files in os.walk(building):
            for name in files:
                with contextlib.suppress(OSError):
                    total += os.lstat(os.path.join(folder, name)).st_size
    return total
