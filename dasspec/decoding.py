"""Decoding: the state of one generation, shared by every method.

Holds the depth cache, the token buffer, the per-position initial states, the stop rule and the statistics.
Invariant between blocks: the committed tokens are ``tokens[:L]`` with ``L = cache.n + 1``; the last committed
token (the *anchor*, at position ``n``) has been emitted but not yet materialised - the next target pass does
that.  Rows and token slots at or beyond ``L`` are scratch for drafts.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .model.cache import CacheCapacityError, DepthCache, bytes_per_token
from .model.layers import Span
from .model.looped import LoopedLM
from .stats import GenerationStats, PhaseTimer
from .stopping import StopRule

if TYPE_CHECKING:
    from .prefix_cache import PrefixCache


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
    """Start a new peak-memory window (CUDA allocator peak, or the process's peak RSS on Linux)."""
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


def check_cache_fits(model: LoopedLM, R: int, positions: int, advice: str) -> None:
    """Raise ``CacheCapacityError`` naming the memory needed when a depth cache of ``positions`` rows at depth R
    would take more than 90% of the device's free memory (before allocating anything)."""
    per = bytes_per_token(model.config, R, model.dtype)
    need, free = per * positions, available_memory(model.device)
    if free is not None and need > 0.9 * free and not os.environ.get("DASSPEC_IGNORE_MEMORY"):
        raise CacheCapacityError(
            f"the depth cache needs {format_bytes(need)} ({per} B/token x {positions} positions at R={R}) but "
            f"only {format_bytes(free)} is free on {model.device}; {advice}")


def full_depth_pass(model: LoopedLM, cache: DepthCache, span: Span, ids: Tensor, h: Tensor, R: int,
                    logit_rows: slice | None = None) -> Tensor:
    """The target on one span: prelude of ``ids`` [W], R aligned core steps from the initial states ``h``
    [1, W, d] (depth r reads and writes the cache at depth r), readout.  Writes the span's K/V at every depth;
    returns float32 logits [W', V] for ``logit_rows``."""
    inj = model.prelude(ids.unsqueeze(0), span, cache)
    for r in range(1, R + 1):
        h = model.core_step(h, inj, span, cache, read=(r, r))
    return model.readout(h, span, cache, rows=logit_rows)[0]


class Decoding:
    def __init__(self, model: LoopedLM, prompt: list[int], stop: StopRule, num_steps: int | None = None,
                 init_scale: float = 1.0, seed: int = 0, width: int = 1, method: str = "ar",
                 streamer=None, prefix_cache: "PrefixCache | None" = None):
        cfg = model.config
        self.model = model
        self.R = model.depth(num_steps)
        P = len(prompt)
        if P == 0:
            raise ValueError("empty prompt: give at least one token (most tokenizers add BOS)")
        self.P = P
        self.prompt = prompt
        self.stop = stop
        if prefix_cache is not None:
            prefix_cache.check(model, self.R, init_scale, seed)
        self.prefix_cache = prefix_cache
        need_ctx = P + stop.max_new_tokens
        if need_ctx > cfg.block_size:
            raise ValueError(f"prompt ({P} tokens) + max_new_tokens ({stop.max_new_tokens}) = {need_ctx} exceeds the "
                             f"model context of {cfg.block_size} positions")
        # Scratch beyond the last committed token: a verifier block of `width` inputs plus its last proposal.
        self.capacity = min(need_ctx + width + 1, cfg.block_size + width + 1)
        device, dtype = model.device, model.dtype
        check_cache_fits(model, self.R, self.capacity, "lower max_new_tokens or num_steps, or use bfloat16")
        reset_peak_memory(device)
        self.static = bool(getattr(model, "static_shapes", False))
        self.cache = DepthCache(cfg, self.R, self.capacity, device, dtype, zeroed=self.static)
        if getattr(model, "compiled", False):
            from torch._dynamo import mark_static_address
            for t in self.cache.tensors():          # CUDA graphs replay into the same cache storage
                mark_static_address(t)
        self.tokens = torch.zeros(self.capacity + 1, dtype=torch.long, device=device)
        self.tokens[:P] = torch.as_tensor(prompt, dtype=torch.long, device=device)
        positions = torch.arange(self.capacity, device=device)
        self.h0 = model.initial_state(positions, init_scale, seed).unsqueeze(0)   # [1, capacity, d]
        self.generated: list[int] = []
        self.done = False
        self.streamer = streamer
        self.stats = GenerationStats(method=method, prompt_tokens=P, cache_bytes=self.cache.nbytes)
        self.timer = PhaseTimer(self.stats, device)
        self._t0 = time.perf_counter()

    # --- positions -----------------------------------------------------------------------------------
    @property
    def n(self) -> int:
        """Materialised (verified) rows; also the position of the anchor."""
        return self.cache.n

    @property
    def budget(self) -> int:
        """Tokens still allowed by max_new_tokens."""
        return self.stop.max_new_tokens - len(self.generated)

    def sequence(self) -> list[int]:
        """Prompt + committed tokens (host copy), for drafters that match on text."""
        return self.tokens[: self.P + len(self.generated)].tolist()

    def span(self, start: int, W: int, positions: Tensor | None = None, mask: Tensor | None = None):
        """The model span for queries at rows [start, start+W) over the current verified prefix (static-shape
        form when the model is set up for it)."""
        return self.model.span(self.cache.n, start, W, positions=positions, mask=mask,
                               static_capacity=self.capacity if self.static else None)

    # --- the full-depth target pass --------------------------------------------------------------------
    def target_pass(self, start: int, W: int, positions: Tensor | None = None,
                    mask: Tensor | None = None, logit_rows: slice | None = None, phase: str = "verify") -> Tensor:
        """Run the target at full depth on token slots [start, start+W) over the verified prefix: prelude, R
        aligned core steps from the target's own initial states (never draft states), readout.  Writes the
        block's K/V at every depth into scratch rows [start, start+W).  Returns float32 logits [W', V].
        Counts R sequential core passes and R*W position-updates for ``phase`` (verify or prefill)."""
        st = self.stats
        setattr(st, phase + "_passes", getattr(st, phase + "_passes") + self.R)
        setattr(st, phase + "_updates", getattr(st, phase + "_updates") + self.R * W)
        span = self.span(start, W, positions=positions, mask=mask)
        h = self.h0[:, start: start + W] if positions is None else self.h0[:, positions]
        return full_depth_pass(self.model, self.cache, span, self.tokens[start: start + W], h, self.R, logit_rows)

    def prefill(self) -> None:
        """Materialise the prompt at every depth and emit the first token.  With a prefix cache, the rows of the
        prompt's longest common prefix with it are copied and only the rest is run (``stats.cached_tokens``)."""
        with self.timer("prefill"):
            m = self.prefix_cache.reusable(self.prompt) if self.prefix_cache is not None else 0
            if m:
                self.cache.load_prefix(self.prefix_cache.cache, m)
                self.stats.cached_tokens = m
            logits = self.target_pass(m, self.P - m, logit_rows=slice(-1, None), phase="prefill")
            self.cache.commit(self.P - m)
            first = int(logits[-1].argmax())
        self.tokens[self.P] = first
        self.emit([first])

    # --- committing ------------------------------------------------------------------------------------
    def emit(self, chunk: list[int]) -> int:
        """Append committed tokens, applying the stop rule inside the chunk; returns how many were kept."""
        start = len(self.generated)
        self.generated.extend(chunk)
        hit = self.stop.scan(self.generated, start)
        if hit is not None:
            keep, reason = hit
            del self.generated[keep:]
            self.done = True
            self.stats.stop_reason = reason
        kept = len(self.generated) - start
        if self.streamer is not None and kept:
            self.streamer.put(torch.tensor([chunk[:kept]]))
        return kept

    def finish(self) -> GenerationStats:
        self.timer.finish()
        if self.model.device.type == "cuda":
            torch.cuda.synchronize()
        self.stats.wall_time = time.perf_counter() - self._t0
        self.stats.new_tokens = len(self.generated)
        self.stats.peak_memory = peak_memory(self.model.device)
        if self.streamer is not None:
            self.streamer.end()
        return self.stats
