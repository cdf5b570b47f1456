"""Device memory: what is free before a depth cache is allocated, and peak-memory windows for benchmarks."""

from __future__ import annotations

import os

import torch

from .cache import CacheCapacityError, bytes_per_token
from .looped import LoopedLM


def _proc_bytes(path: str, key: str) -> int | None:
    """A ``key: N kB`` field of a Linux /proc file, in bytes (None when the platform does not tell)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def available_memory(device: torch.device) -> int | None:
    """Free bytes on the device (None when unknown)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    return _proc_bytes("/proc/meminfo", "MemAvailable")


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak-memory window: CUDA's allocator peak, or (Linux) the process's peak resident set - a
    process-wide counter, so only benchmarks ask for it (``Runtime.track_memory``)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def peak_memory(device: torch.device) -> int | None:
    """Peak bytes since ``reset_peak_memory``: CUDA memory allocated, or resident memory of the process (model
    weights included) on CPU.  None when the platform does not tell."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return _proc_bytes("/proc/self/status", "VmHWM")


def format_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def check_cache_fits(model: LoopedLM, R: int, positions: int, advice: str, window: int | None = None) -> None:
    """Raise ``CacheCapacityError`` naming the memory needed when a depth cache of ``positions`` rows at depth R
    would take more than 90% of the device's free memory (before allocating anything)."""
    per = bytes_per_token(model.config, R, model.dtype, window)
    need, free = per * positions, available_memory(model.device)
    if free is not None and need > 0.9 * free and not os.environ.get("DASSPEC_IGNORE_MEMORY"):
        raise CacheCapacityError(
            f"the depth cache needs {format_bytes(need)} ({per} B/token x {positions} positions at R={R}) but "
            f"only {format_bytes(free)} is free on {model.device}; {advice}")
