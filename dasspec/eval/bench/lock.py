"""One writer per run folder: an advisory lock on ``DIR/.lock`` held for as long as a benchmark may append to
``DIR/records.jsonl``.

Two benchmarks appending to one folder would duplicate records, and a reader that rewrote the file under a writer
would send the writer's later lines to an unlinked inode; so every writer takes this lock first, and a second one is
refused at once with who holds it.  The lock is ``flock`` (``msvcrt.locking`` on Windows): the kernel drops it when
the holder exits, however it exits, so a killed run never leaves a stale lock behind.  ``flock`` is per host: on a
network file system two machines may not see each other's lock (a Ray run writes from its driver only).
"""

from __future__ import annotations

import errno
import os
import socket
import time
from pathlib import Path

LOCK_NAME = ".lock"
BUSY = {errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES, errno.EDEADLK}   # what a held lock raises (flock, msvcrt)


class FolderBusy(ValueError):
    """Another process holds the folder's lock."""


class RunLock:
    """``with RunLock(folder):`` - exclusive, non-blocking; raises ``FolderBusy`` naming the holder."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)
        self.path = self.folder / LOCK_NAME
        self.fd: int | None = None

    def acquire(self) -> "RunLock":
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            _lock(fd)
        except OSError as err:
            if err.errno not in BUSY:               # not contention (e.g. a file system without locks): say so
                os.close(fd)
                raise
            os.lseek(fd, 0, os.SEEK_SET)
            holder = os.read(fd, 400).decode("utf-8", "replace").strip() or "a process"
            os.close(fd)
            raise FolderBusy(f"another run holds {self.folder} ({holder}); wait for it to finish or use another "
                             "--out folder") from None
        # who holds it, for the message a second run gets (the file is never deleted: a new inode would be a
        # second, independent lock)
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%dT%H:%M:%S')}"
                 .encode())
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)               # closing the descriptor drops the lock
            self.fd = None

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


try:
    import fcntl

    def _lock(fd: int) -> None:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
except ImportError:                         # Windows
    import msvcrt

    def _lock(fd: int) -> None:
        msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
