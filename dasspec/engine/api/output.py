"""The output processor: turns what each step committed and measured into what users see - events, streamed
tokens, detokenised text, statistics and results (vLLM v1's ``OutputProcessor`` is the shape).  It is the only
writer of ``GenerationStats``; the scheduler and the executor exchange plain data (``base/contract.py``) and never call
a user's streamer."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch

from ...model.memory import peak_memory
from ..base.contract import StepOutput
from ..core.scheduler import Committed, Entry
from .options import GenerationResult
from .stats import GenerationStats


@dataclass
class StepEvent:
    """What one step did for one request: ``tokens`` committed (after the stop rule), and whether it finished
    (``reason``: eos, stop_string, max_new_tokens, stopping_criteria, cancelled, timeout, error)."""

    id: int
    tokens: list[int]
    finished: bool = False
    reason: str | None = None
    started: bool = False          # admitted this step (it has a batch slot and its first blocks)


@dataclass(eq=False)
class _Output:
    """One request's side of the processor: its statistics, streamer, text decoder and trace."""

    stats: GenerationStats
    streamer: Any = None
    decode: Callable[[list[int]], str] | None = None
    trace: list | None = None
    sent: int = 0                  # generated tokens already reported in events
    started: bool = False          # its prompt went to its streamer
    t0: float = field(default_factory=time.perf_counter)


class OutputProcessor:
    def __init__(self, device: torch.device, track_memory: bool, bytes_per_block: int):
        self.device, self.track_memory, self.bytes_per_block = device, track_memory, bytes_per_block
        self.sync = True             # wall times wait for the device (not with overlap: a step is in flight then)
        self._out: dict[int, _Output] = {}
        self.results: dict[int, GenerationResult] = {}

    def add(self, e: Entry, method: str, streamer=None, decode: Callable[[list[int]], str] | None = None) -> None:
        self._out[e.id] = _Output(GenerationStats(method=method, prompt_tokens=e.P), streamer, decode,
                                  [] if e.trace else None)

    def stats(self, rid: int) -> GenerationStats:
        """A running request's statistics so far (a finished one's are in its result)."""
        return self._out[rid].stats

    def started(self, entries: list[Entry]) -> list[StepEvent]:
        """Requests admitted this step: their prompts go to their streamers first (as in Hugging Face generate)."""
        fresh = [e for e in entries if not self._out[e.id].started]     # (a plan that never ran started it once)
        for e in fresh:
            self._out[e.id].started = True
            self._stream(e, e.prompt)
        return [StepEvent(e.id, [], started=True) for e in fresh]

    def measured(self, out: StepOutput) -> None:
        """What the executor measured per request this step, and the blocks of any trace."""
        for rid, o in out.requests.items():
            r = self._out.get(rid)
            if r is not None:
                r.stats.add(o.counts)
                if r.trace is not None:
                    r.trace.extend(o.trace)

    def committed(self, done: list[Committed], finished: list[Entry]) -> list[StepEvent]:
        """Tokens kept this step: verification events recorded, tokens streamed, events made (a request that
        finished this step gets its tokens in its ``finish`` event)."""
        events, ended = [], {e.id for e in finished}
        for c in done:
            r = self._out[c.entry.id]
            if c.event is not None:
                r.stats.record(*c.event)
            if c.tokens:
                self._stream(c.entry, c.tokens)
                if c.entry.id not in ended:
                    events.append(StepEvent(c.entry.id, list(c.tokens)))
                    r.sent = len(c.entry.generated)
        return events

    def finish(self, e: Entry) -> StepEvent:
        """A request ended: its result is kept until taken (``results``), its streamer ended."""
        r = self._out.pop(e.id)
        stats = r.stats
        stats.stop_reason = str(e.reason or "")
        stats.cached_tokens = e.cached
        stats.cache_bytes = e.peak_blocks * self.bytes_per_block
        if self.device.type == "cuda" and self.sync:
            torch.cuda.synchronize()
        stats.wall_time = time.perf_counter() - r.t0
        stats.new_tokens = len(e.generated)
        if self.track_memory:
            stats.peak_memory = peak_memory(self.device)
        text = None
        if r.decode is not None:
            text = r.decode(e.generated)
            if e.rule.stop_strings:
                text = e.rule.trim_text(text)
        self.results[e.id] = GenerationResult(tokens=list(e.generated), stats=stats, text=text, trace=r.trace,
                                              error=e.error)
        if r.streamer is not None:
            try:
                r.streamer.end()
            except Exception as err:      # noqa: BLE001 - the user's callback: kept in its result, the engine goes on
                if self.results[e.id].error is None:
                    self.results[e.id] = replace(self.results[e.id], error=err)
        return StepEvent(e.id, e.generated[r.sent:], True, e.reason)

    def _stream(self, e: Entry, tokens: list[int]) -> None:
        """Hand tokens to the request's streamer; one that raises fails its own request only."""
        streamer = self._out[e.id].streamer
        if streamer is None:
            return
        try:
            streamer.put(torch.tensor([tokens]))
        except Exception as err:          # noqa: BLE001 - the user's callback: its request fails, not the engine
            e.error = err
