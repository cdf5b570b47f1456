"""Engine: many requests decoded at once, a step at a time - every answer exactly the tokens full-depth AR decoding
gives that request alone.

    engine = dasspec.Engine(model, method="das-wave", max_batch=8)
    a = engine.add(tok.encode("def f(x):"), max_new_tokens=64)
    b = engine.add("Q: 2 + 3 = ?", max_new_tokens=16, do_sample=True, temperature=0.7, seed=4)
    while engine.has_work:
        for event in engine.step():            # per request: tokens committed this step, finished, why
            print(event.id, event.tokens, event.finished, event.reason)
    engine.result(a).text

The table.  A request waits (FIFO) until a batch slot (``max_batch``) and a range of the depth-cache pool (sized
once: ``kv_budget`` positions) are free; its rows are reserved for its worst case (``request.rows_needed``), so a
running request never waits for memory.  A request that could never fit the pool is refused by ``add``.  Each
step then (``loop.step``): requests cancelled or past their deadline end; waiting ones are admitted; every
prefilled request drafts (each drafter for all of its requests at once) and every draft, with the next prompt
chunk of each request still prefilling, is verified in one full-depth pass; a request leaves when its stop rule
says so, and its rows go back to the pool.

Lossless and batch-invariant.  A request reads and writes only its own rows and is verified by the full-depth
target; its prompt is prefilled in chunks whose boundaries depend only on the prompt (multiples of
``prefill_chunk``); its initial states and sampling noise depend only on its seed and positions.  So its tokens are
those of its own batch-1 AR decode whatever else runs, joins, leaves or is cancelled (in float32; tests check it).
How much the engine speculates may change per step (``SpeculationPolicy``): every method emits the same tokens.

Threads: one thread steps the engine; ``add``, ``cancel`` and ``step`` are called from it (the server's worker).
"""

from __future__ import annotations

import itertools
import json
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterable, Iterator

import torch

from ..model.cache import CacheCapacityError
from ..model.looped import LoopedLM
from .draft import Drafter, Session
from .loop import step as loop_step
from .memory import reset_peak_memory
from .options import (GenerationResult, as_token_list, default_stop_ids, drop_hf_options, sampling_options,
                      split_stop)
from .policy import SpeculationPolicy
from .pool import KVPool
from .request import Request, greedy, rows_needed
from .runtime import DEFAULT, Runtime
from .stopping import Criterion, StopRule
from .verify import PrefillChunk

PREFILL_CHUNK = 512        # prompt rows per request per pass (chunk boundaries at multiples of it)
MEMORY_SHARE = 0.5         # the default pool: at most this share of the free device memory


def default_kv_budget(model: LoopedLM, R: int, max_batch: int, width: int) -> int:
    """``max_batch`` requests of the whole context, or as many positions as ``MEMORY_SHARE`` of the free memory
    holds, whichever is less (a larger request is then refused with a message naming kv_budget)."""
    from ..model.cache import bytes_per_token
    from .memory import available_memory

    want = max_batch * rows_needed(model.config.block_size, 0, model.config.block_size, width)
    free = available_memory(model.device)
    if free is None:
        return want
    return max(1, min(want, int(MEMORY_SHARE * free // bytes_per_token(model.config, R, model.dtype))))


@dataclass
class StepEvent:
    """What one step did for one request: ``tokens`` committed (after the stop rule), and whether it finished
    (``reason``: eos, stop_string, max_new_tokens, stopping_criteria, cancelled, timeout)."""

    id: int
    tokens: list[int]
    finished: bool = False
    reason: str | None = None
    started: bool = False          # admitted this step (it has a batch slot and its cache rows)


@dataclass(eq=False)
class Entry:
    """A row of the engine's table."""

    id: int
    prompt: list[int]
    rule: StopRule
    drafter: Drafter
    options: dict                      # Request keyword arguments
    rows: int                          # pool rows reserved
    deadline: float | None
    trace: bool
    decode_text: object = None         # the tokenizer's decode (for .text), or None
    req: Request | None = None
    session: Session | None = None
    cancelled: bool = False
    result: GenerationResult | None = None
    sent: int = 0                      # generated tokens already reported in events


class Engine:
    def __init__(self, model: LoopedLM, method: str = "ar", knobs: dict | None = None, *,
                 num_steps: int | None = None, runtime: Runtime | None = None, max_batch: int = 8,
                 kv_budget: int | None = None, prefill_chunk: int = PREFILL_CHUNK,
                 policy: SpeculationPolicy | None = None, tokenizer=None, sampled_knobs: bool = False,
                 drafter: Drafter | None = None):
        for name, v in (("max_batch", max_batch), ("prefill_chunk", prefill_chunk)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a whole number >= 1, got {v!r}")
        self.model = model
        self.R = model.depth(num_steps)
        self.runtime = runtime or DEFAULT
        self.max_batch, self.prefill_chunk = max_batch, prefill_chunk
        self.policy = policy or SpeculationPolicy()
        self.tokenizer = tokenizer or model.tokenizer
        self._drafters: dict[tuple, Drafter] = {}
        if drafter is not None:                               # a built drafter as the default (generate_batch)
            if knobs or method not in ("ar", drafter.name):
                raise ValueError("give either a drafter or a method and its knobs, not both")
            self.method, self.knobs, self._default = drafter.name, {}, drafter
        else:
            self.method, self.knobs = method, dict(knobs or {})
            self._default = self.drafter(method, self.knobs)  # the default method's knobs fail here, not later
        width = self._default.width
        self.slot_rows = rows_needed(model.config.block_size, 0, model.config.block_size, width)
        if kv_budget is None:
            kv_budget = default_kv_budget(model, self.R, max_batch, width)
        if self.runtime.track_memory:
            reset_peak_memory(model.device)
        # Batched calls may read rows between requests' ranges (masked): they must be finite (pool.py).  A table of
        # one never does; static shapes read every row.
        self.pool = KVPool(model, self.R, kv_budget, finite=max_batch > 1, zeroed=self.runtime.static_shapes)
        self.runtime.prepare_cache(self.pool.tensors())
        self._ids = itertools.count()
        self._table: dict[int, Entry] = {}
        self.waiting: list[Entry] = []
        self.running: list[Entry] = []
        self.steps = 0
        self._events: list[StepEvent] = []     # this step's events so far (kept if the step raises: take_events)

    # --- requests -----------------------------------------------------------------------------------------
    def drafter(self, method: str, knobs: dict | None = None, sampled: bool = False) -> Drafter:
        """The engine's drafter for (method, knobs, greedy or sampled), built and validated on first use and then
        shared by every request that asks for it (its cross-request state: Token Recycling's table)."""
        from ..methods import build_drafter, get_method

        name = get_method(method).name
        key = (name, json.dumps(knobs or {}, sort_keys=True, default=repr), sampled)
        d = self._drafters.get(key)
        if d is None:
            d = self._drafters[key] = build_drafter(self.model, name, dict(knobs or {}), self.R, sampled=sampled)
        return d

    def add(self, prompt, *, max_new_tokens: int = 256, stop: Iterable[int | str] | None = None, eos: bool = True,
            seed: int = 0, init_scale: float = 1.0, do_sample: bool = False, temperature: float | None = None,
            top_k: int | None = None, top_p: float | None = None, min_p: float | None = None,
            stopping_criteria: Iterable[Criterion] | None = None, streamer=None, prefix_cache=None,
            method: str | None = None, knobs: dict | None = None, drafter: Drafter | None = None,
            timeout: float | None = None, trace: bool = False, tokenizer=None,
            exit_threshold: float | None = None, exit_at_step: int | None = None) -> int:
        """Queue a request; returns its id.  Every option is checked here (a request that can never run - longer
        than the context, larger than the pool - is refused now, not when it would start).  ``exit_threshold`` /
        ``exit_at_step``: the target's early exit (Ouro; ``dasspec/model/exit.py``)."""
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an integer, got {seed!r}")
        sampling = sampling_options(do_sample, temperature, top_k, top_p, min_p, seed)
        exit = self.model.exit_rule(exit_threshold, exit_at_step, self.R)
        tok = tokenizer or self.tokenizer
        ids = as_token_list(self.model, prompt, tok)
        if drafter is None:
            if method is None and knobs is None and sampling is None:
                drafter = self._default
            else:
                m = method or self.method
                base = self.knobs if m == self.method else {}
                drafter = self.drafter(m, {**base, **(knobs or {})}, sampled=sampling is not None)
        elif method is not None or knobs:
            raise ValueError("give either a drafter or a method and its knobs, not both")
        extra_ids, stop_strings = split_stop(stop, self.model.config.vocab_size)
        stop_ids = (default_stop_ids(self.model, tok) if eos else []) + extra_ids
        rule = StopRule(max_new_tokens, stop_ids, stop_strings, tok.decode if tok is not None else None,
                        criteria=stopping_criteria or (), prompt=ids)
        P, ctx = len(ids), self.model.config.block_size
        if P == 0:
            raise ValueError("empty prompt: give at least one token (most tokenizers add BOS)")
        if P + rule.max_new_tokens > ctx:
            raise ValueError(f"prompt ({P} tokens) + max_new_tokens ({rule.max_new_tokens}) = "
                             f"{P + rule.max_new_tokens} exceeds the model context of {ctx} positions")
        if prefix_cache is not None:
            prefix_cache.check(self.model, self.R, init_scale, seed)
        if timeout is not None and not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ValueError(f"timeout must be a number of seconds > 0, got {timeout!r}")
        rows = rows_needed(ctx, P, rule.max_new_tokens, drafter.width)
        if self.runtime.static_shapes and self.max_batch > 1:    # every range one size: compiled calls keep shapes
            rows = max(rows, self.slot_rows)      # (a drafter wider than the engine's own gets a size of its own)
        if rows > self.pool.rows:
            raise CacheCapacityError(
                f"the request needs {rows} cache positions (prompt {P} + max_new_tokens {rule.max_new_tokens} + "
                f"the {drafter.name} drafter's {drafter.width + 1}) but the engine's pool holds "
                f"{self.pool.describe()}; lower max_new_tokens or raise kv_budget")
        e = Entry(next(self._ids), ids, rule, drafter,
                  dict(num_steps=self.R, init_scale=init_scale, seed=seed, width=drafter.width, method=drafter.name,
                       streamer=streamer, prefix_cache=prefix_cache, runtime=self.runtime, choose=sampling or greedy,
                       exit=exit),
                  rows, None if timeout is None else time.monotonic() + timeout, trace,
                  decode_text=tok.decode if tok is not None else None)
        self._table[e.id] = e
        self.waiting.append(e)
        return e.id

    def cancel(self, rid: int) -> None:
        """Stop request ``rid`` at the next step (or the next drafting round): what it committed stays."""
        e = self._table.get(rid)
        if e is None:
            raise KeyError(f"no request {rid}")
        e.cancelled = True
        if e.req is not None:
            e.req.cancelled = True

    def result(self, rid: int) -> GenerationResult:
        """The finished request's result (and its row leaves the table)."""
        e = self._table.get(rid)
        if e is None or e.result is None:
            raise KeyError(f"request {rid} is not finished" if e is not None else f"no request {rid}")
        del self._table[rid]
        return e.result

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # --- the step ---------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[StepEvent]:
        """Admit, draft, verify every running request in one pass, commit; the events of this step.  If the step
        raises, the events it had made (requests it finished, admitted or could not admit) are kept for
        ``take_events``; call ``abort_running`` to end the requests whose states the failure left untrusted."""
        events = self._events
        now = time.monotonic()
        for e in list(self.waiting):                       # cancelled or out of time before starting
            reason = "cancelled" if e.cancelled else "timeout" if e.deadline is not None and now > e.deadline else None
            if reason is not None:
                self.waiting.remove(e)
                events.append(self._finish_unstarted(e, reason))
        for e in list(self.running):
            reason = e.req.stopping()
            if reason is not None:
                e.req.end(reason)
                events.append(self._retire(e))
        events += [StepEvent(e.id, [], started=True) for e in self._admit()]
        if not self.running:
            return self.take_events()
        self.steps += 1
        decoding = [e for e in self.running if e.session is not None]
        chunks = [PrefillChunk(e.req, self._chunk(e.req)) for e in self.running if e.session is None]
        cap = self.policy.cap(len(decoding))
        loop_step([e.session for e in decoding], chunks, cap, self._timer)
        for e in list(self.running):
            req = e.req
            if e.session is None and req.prefilled == req.P and not req.done:
                with self._timer("draft", [req]):
                    e.session = e.drafter.start(req)
            if e.session is None and req.prefilled < req.P:
                continue
            if not req.done and req.stopping() is not None:
                req.end(req.stopping())
            if req.done:
                events.append(self._retire(e))
            elif len(req.generated) > e.sent:
                events.append(StepEvent(e.id, req.generated[e.sent:]))
                e.sent = len(req.generated)
        return self.take_events()

    def take_events(self) -> list[StepEvent]:
        """The events made since the last ones returned (after a step raised: what it had done before)."""
        events, self._events = self._events, []
        return events

    def run(self) -> Iterator[StepEvent]:
        """Step until every request has finished, yielding the events."""
        while self.has_work:
            yield from self.step()

    # --- internals --------------------------------------------------------------------------------------------
    def _chunk(self, req: Request) -> int:
        """The next prompt chunk: up to the next multiple of ``prefill_chunk`` (boundaries depend on the prompt only,
        so its rows are computed the same way whatever else is in the batch)."""
        C = self.prefill_chunk
        return min(req.P, (req.prefilled // C + 1) * C) - req.prefilled

    def _admit(self) -> list[Entry]:
        admitted = []
        while self.waiting and len(self.running) < self.max_batch:
            e = self.waiting[0]
            view = self.pool.allocate(e.rows)
            if view is None:                               # first in, first served: the head waits for rows
                break
            self.waiting.pop(0)
            try:
                e.req = Request(self.model, e.prompt, e.rule, cache=view, **e.options)
                e.req.deadline, e.req.cancelled = e.deadline, e.cancelled
                e.req.trace = [] if e.trace else None
                streamer = e.options.get("streamer")
                if streamer is not None:                   # as in Hugging Face generate: the prompt first
                    streamer.put(torch.tensor([e.prompt]))
                e.req.load_prefix()
            except BaseException:
                self.pool.release(view)
                self._events.append(self._finish_unstarted(e, "error"))      # never left without a result
                raise
            self.running.append(e)
            admitted.append(e)
        return admitted

    def abort_running(self, reason: str = "error") -> list[int]:
        """End every running request now (after a step failed: their states cannot be trusted); returns their ids.
        Their rows go back to the pool; waiting requests stay queued."""
        ids = []
        for e in list(self.running):
            e.req.end(reason)
            self._retire(e)
            ids.append(e.id)
        return ids

    def _retire(self, e: Entry) -> StepEvent:
        req = e.req
        stats = req.finish()
        self.running.remove(e)
        self.pool.release(req.cache)
        text = None
        if e.decode_text is not None:
            text = e.decode_text(req.generated)
            if e.rule.stop_strings:
                text = e.rule.trim_text(text)
        e.result = GenerationResult(tokens=list(req.generated), stats=stats, text=text, trace=req.trace)
        ev = StepEvent(e.id, req.generated[e.sent:], True, stats.stop_reason)
        e.sent = len(req.generated)
        e.req = e.session = None                           # the cache view and states are free now
        return ev

    def _finish_unstarted(self, e: Entry, reason: str) -> StepEvent:
        from .stats import GenerationStats

        stats = GenerationStats(method=e.drafter.name, prompt_tokens=len(e.prompt), stop_reason=reason)
        e.result = GenerationResult(tokens=[], stats=stats, text="" if e.decode_text is not None else None,
                                    trace=[] if e.trace else None)
        streamer = e.options.get("streamer")
        if streamer is not None:
            streamer.end()
        return StepEvent(e.id, [], True, reason)

    @staticmethod
    @contextmanager
    def _timer(phase: str, reqs: list[Request]):
        """Charge ``phase`` to every request in ``reqs`` (they share the batched passes)."""
        if not reqs:
            yield
            return
        if reqs[0].timer.cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            yield
            b.record()
            for r in reqs:
                r.timer._events.append((phase, a, b))
            return
        t = time.perf_counter()
        yield
        dt = time.perf_counter() - t
        attr = phase + "_time"
        for r in reqs:
            setattr(r.stats, attr, getattr(r.stats, attr) + dt)
