"""KVPool: the depth cache of every running sequence, allocated once to a budget of positions, and the row ranges
handed out of it.

A sequence needs at most ``prompt + max_new_tokens + width + 1`` rows (``Request.rows_needed``: its prompt, its
output, and the scratch its drafter's widest draft writes past the last committed token), known when it is added.
It gets one contiguous range of that many rows (first fit) for its whole life - ``DepthCache.view`` over the
range - so its rows are a plain slice at every depth and no step ever moves or gathers them.  A range returns to
the free list (merged with its free neighbours) when the sequence ends.  A request larger than the whole pool can
never run and is refused when it is added; one that does not fit now waits until enough rows are free.

The storage never moves, so CUDA-graph replays read and write the same addresses for the pool's whole life.
A batched call may read every row between two requests' ranges under a mask, and a masked weight of 0 times a NaN
is still NaN, so ``finite`` pools hold finite values in every row a call can reach: rows are zeroed once, the first
time a range reaches them (first fit hands out low rows first, so only the rows in use are ever touched).
"""

from __future__ import annotations

import bisect

import torch

from ..model.cache import DepthCache, bytes_per_token
from ..model.looped import LoopedLM
from .memory import check_cache_fits, format_bytes


class KVPool:
    def __init__(self, model: LoopedLM, R: int, rows: int, finite: bool = False, zeroed: bool = False):
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
            raise ValueError(f"kv_budget must be a whole number of positions >= 1, got {rows!r}")
        check_cache_fits(model, R, rows, "lower kv_budget (positions kept for running requests) or use bfloat16")
        self.R, self.rows = R, rows
        self.cache = DepthCache(model.config, R, rows, model.device, model.dtype, zeroed=zeroed)
        self._free: list[tuple[int, int]] = [(0, rows)]      # (start, length), sorted by start, never adjacent
        self._finite_to = rows if zeroed or not finite else 0   # rows [0, _finite_to) hold finite values

    @staticmethod
    def rows_for_bytes(model: LoopedLM, R: int, nbytes: int) -> int:
        """The positions a budget of ``nbytes`` holds at depth R."""
        return int(nbytes // bytes_per_token(model.config, R, model.dtype))

    @property
    def free_rows(self) -> int:
        return sum(n for _, n in self._free)

    @property
    def largest_free(self) -> int:
        return max((n for _, n in self._free), default=0)

    def describe(self) -> str:
        return f"{self.rows} positions ({format_bytes(self.cache.nbytes)})"

    def allocate(self, rows: int) -> DepthCache | None:
        """A view of ``rows`` free rows (the first free range that holds them), or None when none does now."""
        for i, (start, n) in enumerate(self._free):
            if n >= rows:
                if n == rows:
                    del self._free[i]
                else:
                    self._free[i] = (start + rows, n - rows)
                if start + rows > self._finite_to:
                    for t in self.cache.tensors():
                        t[..., self._finite_to: start + rows, :].zero_()
                    self._finite_to = start + rows
                return self.cache.view(start, rows)
        return None

    def release(self, view: DepthCache) -> None:
        """Give a view's rows back (merged with free neighbours)."""
        start, n = view.base - self.cache.base, view.capacity
        i = bisect.bisect(self._free, (start, n))
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] > start or \
                i < len(self._free) and start + n > self._free[i][0]:
            raise RuntimeError(f"rows [{start}, {start + n}) released twice")
        if i < len(self._free) and start + n == self._free[i][0]:       # merge with the next free range
            n += self._free.pop(i)[1]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == start:   # and with the previous one
            start, m = self._free[i - 1]
            self._free[i - 1] = (start, m + n)
        else:
            self._free.insert(i, (start, n))

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.cache.tensors()
