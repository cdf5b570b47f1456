"""One decode worker per loaded model: a thread that runs ``dasspec.generate`` for one request at a time (batch 1:
DAS-Wave is a latency method) from a bounded FIFO queue.

    job = Job(loop, prompt, drafter, params, stop_strings, endpoint)
    worker.submit(job)          # QueueFull when max_queue requests already wait -> 429 at once
    event = await job.events.get()   # Started, Delta(text, tokens)..., then Done(result, tail) or Failed(error)
                                     # (or Cancelled, when cancelled before it started)
    worker.cancel(job)          # the client went away: a waiting job leaves the queue (its slot is free at once),
                                # the running one stops at its next verification step

The worker hands events to the event loop with ``call_soon_threadsafe``; the text in them is released
incrementally (``textstream.IncrementalText``), so the concatenated deltas plus ``Done.tail`` equal the
non-streamed text.  A failing request fails alone: the worker catches it, reports it on the job, and goes on.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from ..engine.draft import Drafter
from ..engine.generate import GenerationResult, generate
from ..model.cache import CacheCapacityError
from ..model.looped import LoopedLM
from .metrics import ServerMetrics
from .textstream import IncrementalText

log = logging.getLogger("dasspec.serve")


class QueueFull(Exception):
    """Every queue slot is taken."""


@dataclass
class Started:
    queue_time: float                # seconds between submit and the start of decoding


@dataclass
class Delta:
    text: str                        # new text released by this chunk (may be empty: held back)
    tokens: int                      # tokens committed in this chunk


@dataclass
class Done:
    result: GenerationResult
    tail: str                        # the text still to send after the deltas
    cancelled: bool                  # stopped because the client went away


@dataclass
class Failed:
    error: Exception


@dataclass
class Cancelled:
    """Cancelled while waiting in the queue: it never started."""


def is_client_error(err: Exception) -> bool:
    """A request the server cannot serve as asked (bad value, does not fit the context or memory): a 400, not a
    server fault."""
    return isinstance(err, (ValueError, CacheCapacityError))


@dataclass(eq=False)
class Job:
    loop: asyncio.AbstractEventLoop
    prompt: list[int]
    drafter: Drafter
    params: dict[str, Any]           # generate() options: max_new_tokens, stop, seed, sampling
    endpoint: str                    # for the metrics: "completions" or "chat"
    stream: bool = True              # False: no incremental text (the reply is the result's text)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    submitted: float = field(default_factory=time.perf_counter)
    cancelled: threading.Event = field(default_factory=threading.Event)
    finished: bool = False           # Done / Failed posted (or cancelled while waiting)

    def post(self, event) -> None:
        """Hand ``event`` to the event loop (from any thread)."""
        if isinstance(event, (Done, Failed, Cancelled)):
            self.finished = True
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:            # the loop is closed: the server is shutting down, nobody is listening
            pass

    def stop_requested(self, input_ids, scores) -> bool:
        """A stopping criterion (asked after every committed token): true once the job is cancelled."""
        return self.cancelled.is_set()


class _Streamer:
    """Hugging Face's streamer protocol for one job: the first ``put`` is the prompt (decoding has started), then
    one per committed chunk."""

    def __init__(self, job: Job, text: IncrementalText | None):
        self.job, self.text = job, text
        self.started = False
        self.first_token: float | None = None
        self.last_token: float | None = None

    def put(self, chunk: torch.Tensor) -> None:
        if not self.started:
            self.started = True
            self.job.post(Started(time.perf_counter() - self.job.submitted))
            return
        ids = chunk.reshape(-1).tolist()
        now = time.perf_counter()
        self.first_token = self.first_token or now
        self.last_token = now
        self.job.post(Delta(self.text.feed(ids) if self.text is not None else "", len(ids)))

    def end(self) -> None:
        pass


class DecodeWorker:
    """The model's single decode thread and its bounded FIFO queue of waiting jobs."""

    def __init__(self, model: LoopedLM, max_queue: int, metrics: ServerMetrics | None = None):
        if isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 0:
            raise ValueError(f"max_queue must be an integer >= 0, got {max_queue!r}")
        self.model, self.max_queue = model, max_queue
        self.metrics = metrics
        self._waiting: deque[Job] = deque()
        self._running: Job | None = None
        self._cv = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="dasspec-decode", daemon=True)
        self._thread.start()

    # --- the event loop's side ------------------------------------------------------------------------------
    def submit(self, job: Job) -> None:
        with self._cv:
            if self._closing:
                raise QueueFull("the server is shutting down")
            # max_queue jobs may wait while one decodes (a job not yet picked up counts as waiting)
            if len(self._waiting) + (self._running is not None) > self.max_queue:
                raise QueueFull(f"all {self.max_queue} queue slots are taken")
            self._waiting.append(job)
            self._cv.notify()

    def cancel(self, job: Job) -> None:
        """Stop ``job``: out of the queue if it is waiting, else at its next verification step."""
        with self._cv:
            job.cancelled.set()
            if job in self._waiting:
                self._waiting.remove(job)
                job.post(Cancelled())
                self._count(job.endpoint, "cancelled")

    @property
    def queue_length(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return int(self._running is not None)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def close(self, timeout: float = 10.0) -> None:
        """Cancel every job and stop the thread (server shutdown)."""
        with self._cv:
            self._closing = True
            for job in list(self._waiting):
                self.cancel(job)
            if self._running is not None:
                self._running.cancelled.set()
            self._cv.notify_all()
        self._thread.join(timeout)

    # --- the worker thread ----------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._waiting and not self._closing:
                    self._cv.wait()
                if self._closing:
                    return
                job = self._running = self._waiting.popleft()
            if job.cancelled.is_set():           # cancelled between leaving the queue and starting
                with self._cv:
                    self._running = None
                job.post(Cancelled())
                self._count(job.endpoint, "cancelled")
                continue
            try:
                self._execute(job)
            finally:
                with self._cv:
                    self._running = None

    def _execute(self, job: Job) -> None:
        tok = self.model.tokenizer
        stops = [s for s in job.params.get("stop") or [] if isinstance(s, str)]
        # (re-decoding the text per chunk costs O(n^2) in tokens: only for a stream)
        streamer = _Streamer(job, IncrementalText(tok.decode, stops) if job.stream else None)
        try:
            result = generate(self.model, job.prompt, drafter=job.drafter, streamer=streamer,
                              stopping_criteria=[job.stop_requested], **job.params)
            tail = streamer.text.finish(result.text or "") if streamer.text is not None else ""
        except Exception as err:                # this request fails alone; the worker goes on
            client = is_client_error(err)
            if not client:
                log.exception("request failed")
            self._count(job.endpoint, "invalid" if client else "error")
            job.post(Failed(err))
            return
        cancelled = job.cancelled.is_set() and result.stop_reason == "stopping_criteria"
        self._record(job, result, streamer, cancelled)
        job.post(Done(result, tail, cancelled))

    # --- metrics --------------------------------------------------------------------------------------------
    def _count(self, endpoint: str, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.requests.inc(endpoint=endpoint, outcome=outcome)

    def _record(self, job: Job, result: GenerationResult, streamer: _Streamer, cancelled: bool) -> None:
        m = self.metrics
        if m is None:
            return
        s = result.stats
        self._count(job.endpoint, "cancelled" if cancelled else "ok")
        m.prompt_tokens.inc(s.prompt_tokens)
        m.generated_tokens.inc(s.new_tokens, method=s.method)
        m.accepted.observe_many(s.accepted, method=s.method)
        m.committed.observe_many([a + u for a, u in zip(s.accepted, s.target_tokens)], method=s.method)
        if streamer.first_token is not None:
            m.ttft.observe(streamer.first_token - job.submitted, method=s.method)
            if s.new_tokens > 1:
                m.time_per_token.observe((streamer.last_token - streamer.first_token) / (s.new_tokens - 1),
                                         method=s.method)
