"""One decode worker per loaded model: a thread that steps the batched ``Engine`` - every running request verified
in one pass per step, requests joining and leaving between steps (continuous batching) - fed from a bounded queue.

    job = Job(loop, prompt, drafter, params, endpoint)
    worker.submit(job)          # QueueFull when max_batch requests run and max_queue wait -> 429 at once
    event = await job.events.get()   # Started, Delta(text, tokens)..., then Done(result, tail) or Failed(error)
                                     # (or Cancelled, when cancelled before it started)
    worker.cancel(job)          # the client went away: the engine drops it at the next step (or drafting round)

The worker hands events to the event loop with ``call_soon_threadsafe``; the text in them is released
incrementally (``textstream.IncrementalText``), so the concatenated deltas plus ``Done.tail`` equal the
non-streamed text.  A request the engine refuses fails alone (a 400); a step that raises fails the requests that
were running in it (their states cannot be trusted), and the worker goes on with the others.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from ..engine.api.engine import Engine, StepEvent
from ..engine.api.generate import GenerationResult
from ..engine.drafting.draft import Drafter
from ..model.cache import CacheCapacityError
from .metrics import ServerMetrics
from .schema import APIError
from .textstream import IncrementalText

log = logging.getLogger("dasspec.serve")


class QueueFull(Exception):
    """Every batch slot and queue slot is taken."""


@dataclass
class Started:
    queue_time: float                # seconds between submit and the start of decoding


@dataclass
class Delta:
    text: str                        # new text released by this chunk (may be empty: held back)
    tokens: int                      # tokens committed in this chunk
    ids: list[int] = field(default_factory=list)   # their ids (a failover re-run is compared with them)


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
    """Cancelled before it started: it never decoded."""


def is_client_error(err: Exception) -> bool:
    """A request the server cannot serve as asked (bad value, does not fit the context or memory): a 400, not a
    server fault."""
    return isinstance(err, (ValueError, CacheCapacityError))


def error_for(err: Exception) -> APIError:
    """A worker-side failure as an API error (already counted in the metrics by the worker, or - an ``APIError``
    a cluster replica answered - where it was raised)."""
    if isinstance(err, APIError):
        return err
    e = APIError(400, str(err)) if is_client_error(err) else \
        APIError(500, f"internal error: {type(err).__name__}: {err}", type="server_error")
    e.counted = True
    return e


@dataclass(eq=False)
class Job:
    loop: asyncio.AbstractEventLoop
    prompt: list[int]
    drafter: Drafter
    params: dict[str, Any]           # Engine.add options: max_new_tokens, stop, seed, sampling
    endpoint: str                    # for the metrics: "completions" or "chat"
    stream: bool = True              # False: no incremental text (the reply is the result's text)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    submitted: float = field(default_factory=time.perf_counter)
    cancelled: threading.Event = field(default_factory=threading.Event)
    finished: bool = False           # Done / Failed / Cancelled posted
    rid: int | None = None           # the engine's id, once added
    started: bool = False            # admitted by the engine (a batch slot and cache rows)
    text: IncrementalText | None = None
    first_token: float | None = None
    last_token: float | None = None

    def post(self, event) -> None:
        """Hand ``event`` to the event loop (from any thread)."""
        if isinstance(event, (Done, Failed, Cancelled)):
            self.finished = True
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:            # the loop is closed: the server is shutting down, nobody is listening
            pass


class DecodeWorker:
    """The model's single decode thread stepping one ``Engine``, and its bounded queue."""

    def __init__(self, engine: Engine, max_queue: int, metrics: ServerMetrics | None = None,
                 request_timeout: float | None = None):
        if isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 0:
            raise ValueError(f"max_queue must be an integer >= 0, got {max_queue!r}")
        self.engine, self.max_queue = engine, max_queue
        self.metrics = metrics
        self.request_timeout = request_timeout
        self._incoming: deque[Job] = deque()          # submitted, not yet handed to the engine
        self._cancels: deque[Job] = deque()
        self._jobs: dict[int, Job] = {}               # engine id -> job
        self._pending = 0                             # submitted and not finished
        self._running = 0                             # admitted by the engine and not finished
        self._cv = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="dasspec-decode", daemon=True)
        self._thread.start()

    # --- the event loop's side ------------------------------------------------------------------------------
    def submit(self, job: Job) -> None:
        with self._cv:
            if self._closing:
                raise QueueFull("the server is shutting down")
            if self._pending >= self.engine.max_batch + self.max_queue:
                raise QueueFull(f"all {self.engine.max_batch} batch slots and {self.max_queue} queue slots are "
                                "taken")
            self._pending += 1
            self._incoming.append(job)
            self._cv.notify()

    def cancel(self, job: Job) -> None:
        """Stop ``job``: out of the queue if the engine has not got it, else at the engine's next step."""
        with self._cv:
            if job.cancelled.is_set() or job.finished:
                return
            job.cancelled.set()
            if job in self._incoming:
                self._incoming.remove(job)
                self._pending -= 1
                job.post(Cancelled())
                self._count(job.endpoint, "cancelled")
            else:
                self._cancels.append(job)
                self._cv.notify()

    @property
    def queue_length(self) -> int:
        """Requests accepted and not yet decoding."""
        return self._pending - self._running

    @property
    def running(self) -> int:
        """Requests being decoded (the engine's batch, prefilling ones included)."""
        return self._running

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def close(self, timeout: float = 10.0) -> None:
        """Cancel every job and stop the thread (server shutdown)."""
        with self._cv:
            self._closing = True
            for job in list(self._incoming):
                job.cancelled.set()
                job.post(Cancelled())
            self._incoming.clear()
            for job in self._jobs.values():
                job.cancelled.set()
            self._cv.notify_all()
        self._thread.join(timeout)

    # --- the worker thread ----------------------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        while True:
            with self._cv:
                while not (self._incoming or self._cancels or engine.has_work or self._closing):
                    self._cv.wait()
                if self._closing:
                    break
                new, cancels = list(self._incoming), list(self._cancels)
                self._incoming.clear()
                self._cancels.clear()
            for job in new:
                self._add(job)
            for job in cancels:
                if job.rid is not None and job.rid in self._jobs:
                    engine.cancel(job.rid)
            if not engine.has_work:
                continue
            t = time.perf_counter()
            batch = len(engine.running)
            try:
                events = engine.step()
            except Exception as err:                    # the requests of this step fail; queued ones go on
                log.exception("a decode step failed")
                failed = set(engine.abort_running())
                for ev in engine.take_events():         # what the step had done before it failed
                    if ev.id not in failed:
                        self._dispatch(ev)
                for rid in failed:
                    engine.discard(rid)                 # its result is never read: it leaves the engine's table
                    if rid in self._jobs:
                        self._fail(self._jobs.pop(rid), err)
                continue
            for ev in events:
                self._dispatch(ev)
            if self.metrics is not None:
                self.metrics.step(max(batch, len(engine.running)), sum(len(ev.tokens) for ev in events),
                                  time.perf_counter() - t)
        for job in self._jobs.values():                 # shutdown: nobody is listening any more
            job.post(Cancelled())

    def _add(self, job: Job) -> None:
        if job.cancelled.is_set():
            with self._cv:
                self._pending -= 1
            job.post(Cancelled())
            self._count(job.endpoint, "cancelled")
            return
        try:
            job.rid = self.engine.add(job.prompt, drafter=job.drafter, timeout=self.request_timeout, **job.params)
        except Exception as err:
            self._fail(job, err)
            return
        stops = [s for s in job.params.get("stop") or [] if isinstance(s, str)]
        if job.stream:
            job.text = IncrementalText(self.engine.model.tokenizer.decode, stops)
        self._jobs[job.rid] = job

    def _dispatch(self, ev: StepEvent) -> None:
        job = self._jobs.get(ev.id)
        if job is None:
            if ev.finished:
                self.engine.discard(ev.id)                # nobody will read it
            return
        now = time.perf_counter()
        if ev.started:
            job.started = True
            with self._cv:
                self._running += 1
            job.post(Started(now - job.submitted))
        if ev.tokens:
            job.first_token = job.first_token or now
            job.last_token = now
            text = job.text.feed(ev.tokens) if job.text is not None else ""
            job.post(Delta(text, len(ev.tokens), list(ev.tokens)))
        if not ev.finished:
            return
        del self._jobs[ev.id]
        result = self.engine.result(ev.id)
        if ev.reason == "error":                          # this request alone failed (its setup, its streamer)
            self._fail(job, result.error or RuntimeError("the request failed"))
            return
        self._leave(job)
        cancelled = ev.reason == "cancelled"
        if cancelled and not job.started:                 # cancelled while it waited for a slot: never decoded
            job.post(Cancelled())
            self._count(job.endpoint, "cancelled")
            return
        try:
            tail = job.text.finish(result.text or "") if job.text is not None else ""
        except RuntimeError as err:
            self._count(job.endpoint, "error")
            job.post(Failed(err))
            return
        self._record(job, result, cancelled)
        job.post(Done(result, tail, cancelled))

    def _leave(self, job: Job) -> None:
        with self._cv:
            self._pending -= 1
            if job.started:
                self._running -= 1

    def _fail(self, job: Job, err: Exception) -> None:
        client = is_client_error(err)
        if not client:
            log.error("request failed: %s: %s", type(err).__name__, err)
        self._leave(job)
        self._count(job.endpoint, "invalid" if client else "error")
        job.post(Failed(err))

    # --- metrics --------------------------------------------------------------------------------------------
    def _count(self, endpoint: str, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.requests.inc(endpoint=endpoint, outcome=outcome)

    def _record(self, job: Job, result: GenerationResult, cancelled: bool) -> None:
        m = self.metrics
        if m is None:
            return
        s = result.stats
        self._count(job.endpoint, "cancelled" if cancelled else "ok")
        m.prompt_tokens.inc(s.prompt_tokens)
        m.cached_tokens.inc(s.cached_tokens)
        m.generated_tokens.inc(s.new_tokens, method=s.method)
        for drafter, steps in s.choices.items():
            m.choices.inc(steps, method=s.method, drafter=drafter)
        m.accepted.observe_many(s.accepted, method=s.method)
        m.committed.observe_many([a + u for a, u in zip(s.accepted, s.target_tokens)], method=s.method)
        if job.first_token is not None:
            m.ttft.observe(job.first_token - job.submitted, method=s.method)
            if s.new_tokens > 1:
                m.time_per_token.observe((job.last_token - job.first_token) / (s.new_tokens - 1), method=s.method)
