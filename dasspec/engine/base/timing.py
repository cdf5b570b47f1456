"""Timing without host synchronisation: the one place that knows how a stretch of work is timed on each device."""

from __future__ import annotations

import time
from typing import Callable

import torch


class Lap:
    """The seconds of the work between ``start()`` and ``stop()`` on ``device``: on a CUDA device two events recorded
    on its current stream, read by ``seconds()`` only once the device has passed the second (after the engine's one
    synchronisation per step), so timing a drafter never stalls the host; otherwise (a CPU, or None: host work) the
    host ``clock``."""

    __slots__ = ("cuda", "clock", "device", "_a", "_b", "_t")

    def __init__(self, device: torch.device | None = None, clock: Callable[[], float] = time.perf_counter):
        self.cuda = device is not None and torch.device(device).type == "cuda"
        self.clock, self.device = clock, device
        self._a = self._b = None
        self._t = 0.0

    def start(self) -> "Lap":
        if self.cuda:
            self._a = torch.cuda.Event(enable_timing=True)
            self._a.record(torch.cuda.current_stream(self.device))
        else:
            self._t = self.clock()
        return self

    def stop(self) -> "Lap":
        if self.cuda:
            self._b = torch.cuda.Event(enable_timing=True)
            self._b.record(torch.cuda.current_stream(self.device))
        else:
            self._t = self.clock() - self._t
        return self

    def wait(self) -> None:
        """Block until the device has passed ``stop()`` (the engine calls it once per step, on the step's last lap)."""
        if self.cuda and self._b is not None:
            self._b.synchronize()

    def seconds(self) -> float:
        return self._a.elapsed_time(self._b) / 1e3 if self.cuda else self._t
