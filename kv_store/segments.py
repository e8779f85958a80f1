"""The cluster's POSIX shared-memory segments: their names, their creation and their cleanup.

Names are made here only: the kv_store's pool `pulseinfer-kv-<pid>-<random>`, a CPU worker's
cache `pulseinfer-cache-<pid>`, each from numbers the process knows. A name read
from a socket is opened only if it has one of those shapes, as a regular file of the expected
size: no client can make a process map, probe or unlink another file.

The process that creates a segment owns it: it holds a shared flock on it for as long as it lives
and unlinks it when it closes. The kernel drops the lock when the process dies (kill -9
included, in any pid namespace), so a segment that nobody holds is stale, and `sweep` removes
exactly those; every service sweeps when it starts.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import re
import secrets
import stat
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("kv_store.segments")
SHM_DIR = Path("/dev/shm")
NAME = re.compile(r"pulseinfer-(kv-[0-9]+-[0-9a-f]{8}|cache-[0-9]+)")


def pool_name() -> str:
    """A new name for a kv_store's pool (random: two stores with the same pid in two containers sharing /dev/shm never clash)."""
    return f"pulseinfer-kv-{os.getpid()}-{secrets.token_hex(4)}"


def cache_name(pid: int) -> str:
    """The name of the cache segment of the worker process `pid`: made by that worker, derived by the
    kv_store from the pid the worker registered with, never read from a socket."""
    return f"pulseinfer-cache-{int(pid)}"


def checked(name: str) -> Path:
    if not NAME.fullmatch(name):
        raise ValueError(f"{name[:80]!r} is not the name of a PulseInfer shared-memory segment")
    return SHM_DIR / name


class Segment:
    """A segment this process creates: exclusive, zero-filled, locked while this process lives,
    unlinked by `close`. Its pages stay mapped (in `map` and the tensors over it) until those go."""

    def __init__(self, name: str, size: int):
        self.name = name
        self.path = checked(name)
        self._fd = self._create()
        try:
            os.ftruncate(self._fd, size)
            self.map = mmap.mmap(self._fd, size)
        except OSError:
            self.close()
            raise

    def _create(self) -> int:
        while True:
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW, 0o600)
            except FileExistsError:
                raise FileExistsError(f"shared-memory segment {self.path} exists and its creator is alive") from None
            if hold(fd):
                return fd
            os.close(fd)

    def close(self) -> None:
        if self._fd >= 0:
            self.path.unlink(missing_ok=True)
            os.close(self._fd)  # releases the lock
            self._fd = -1


def open_segment(name: str, size: int) -> mmap.mmap:
    """Maps another process's segment `name` (checked), which must be a regular file of `size` bytes."""
    fd = os.open(checked(name), os.O_RDWR | os.O_NOFOLLOW)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size != size:
            raise ValueError(f"segment {name} is {info.st_size} bytes, expected {size}")
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def hold(fd: int) -> bool:
    """Marks the file (or directory) open at `fd` as in use for as long as this process keeps `fd`
    open. False: a sweep removed it between its creation and now; make another."""
    fcntl.flock(fd, fcntl.LOCK_SH)
    return os.fstat(fd).st_nlink > 0


def remove_unheld(path: Path, remove: Callable[[Path], object]) -> bool:
    """Removes `path` with `remove` if no process holds it (see `hold`); True if it did."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False  # gone meanwhile, or a link
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        remove(path)  # under the lock: a creator racing us finds its file unlinked when it gets its lock
        return True
    except BlockingIOError:
        return False  # its creator lives
    finally:
        os.close(fd)


def sweep() -> list[str]:
    """Unlinks every PulseInfer segment whose creator is gone (nobody holds it); logs and returns their names."""
    paths = [p for p in SHM_DIR.glob("pulseinfer-*") if NAME.fullmatch(p.name)]
    removed = [p.name for p in paths if remove_unheld(p, Path.unlink)]
    for name in removed:
        log.warning("removed %s, left behind by a process that was killed", name)
    return removed
