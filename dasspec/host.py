"""The machine a command runs on: how many CPU threads to use when other processes share the cores, and output
paths checked before any work starts (so a long run never fails at its last step because of its --out).

Imports nothing heavy: ``dasspec --help`` and argument checks run before torch is loaded.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:                  # macOS, Windows: no affinity mask
        return os.cpu_count() or 1


def idle_cores(own_threads: int = 0) -> float:
    """Cores the 1-minute load average leaves idle, not counting ``own_threads`` threads of this process that are
    already running (they are part of the load but not competitors)."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):       # no load average (Windows): assume the machine is ours
        return float(usable_cores())
    return usable_cores() - max(0.0, load - own_threads)


def fair_threads(wanted: int, own_threads: int = 0) -> int:
    """``wanted`` threads, or fewer while other processes occupy the cores: as many as the load average leaves
    idle, at least one.  An OpenMP thread that waits for a core another job holds stalls every operation of the
    step, so on a shared CPU fewer threads run faster (docs/performance-journal.md, "Threads on a loaded shared
    CPU")."""
    return max(1, min(wanted, int(idle_cores(own_threads) + 0.5)))


THREADS_HELP = ("torch intra-op threads on CPU (default: torch's, lowered to the cores the 1-minute load average "
                "leaves idle, at least 1: on a shared CPU fewer threads run faster)")


def set_threads(requested: int | None) -> int:
    """Torch's intra-op threads: ``requested`` (--threads), else torch's default lowered to the cores the load
    average leaves idle - on a shared CPU a thread that waits for a busy core slows every step."""
    import torch        # lazy: every command's parser imports this module; `dasspec --help` loads no torch

    check_threads(requested)
    threads = requested or fair_threads(torch.get_num_threads())
    torch.set_num_threads(threads)
    return threads


def check_threads(requested: int | None, flag: str = "--threads") -> None:
    """``requested`` threads, refused unless 1 .. the cores this process may use: more only queue for the same
    cores (5000 ran 60x slower) and past OpenMP's limits crash the process."""
    if requested is None:
        return
    if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
        raise ValueError(f"{flag} must be >= 1, got {requested}")
    cores = usable_cores()
    if requested > cores:
        raise ValueError(f"{flag} {requested} is more than the {cores} CPU core(s) this process may use; give at "
                         f"most {cores}")


def check_out_dir(path: str | os.PathLike, flag: str = "--out") -> Path:
    """``path`` as an output folder, checked before the work: a folder that can be written, or one that does not
    exist yet under a writable parent.  Raises ``ValueError`` naming ``flag`` and the path; creates nothing."""
    out = Path(path).expanduser()
    if out.exists() and not out.is_dir():
        raise ValueError(f"{flag} {out}: is a file, not a folder")
    problem = unwritable_reason(out)
    if problem:
        raise ValueError(f"{flag} {out}: {problem}")
    return out


def check_out_file(path: str | os.PathLike, flag: str) -> Path:
    """``path`` as a file to be written after the work, checked now: not a folder, its folder writable."""
    out = Path(path).expanduser()
    if out.is_dir():
        raise ValueError(f"{flag} {out}: is a folder, not a file")
    problem = unwritable_reason(out.parent) or (None if not out.exists() or writable(out) else "it is not writable")
    if problem:
        raise ValueError(f"{flag} {out}: {problem}")
    return out


def unwritable_reason(folder: Path) -> str | None:
    """Why files cannot be created in ``folder`` (or in the folders to be made down to it), or None."""
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is a file, not a folder"
    if not writable(existing):
        return f"{existing} is not writable (read-only, or no permission)"
    return None


def writable(path: Path) -> bool:
    """Whether this process may create files in (or write to) ``path``, found by trying: a temporary file made and
    removed in a folder, a file opened for appending (nothing written).  Permission bits alone say nothing for
    root, nor for /proc or a full or read-only file system."""
    try:
        if path.is_dir():
            fd, name = tempfile.mkstemp(dir=path, prefix=".dasspec-write-check-")
            os.close(fd)
            os.unlink(name)
        else:
            os.close(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK))
    except OSError:
        return False
    return True
