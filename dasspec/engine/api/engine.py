"""Engine: many requests decoded at once, a step at a time - every answer exactly the tokens full-depth AR decoding
gives that request alone.

    engine = dasspec.Engine(model, method="das-wave", max_batch=8)
    a = engine.add(tok.encode("def f(x):"), max_new_tokens=64)
    b = engine.add("Q: 2 + 3 = ?", max_new_tokens=16, do_sample=True, temperature=0.7, seed=4)
    while engine.has_work:
        for event in engine.step():            # per request: tokens committed this step, finished, why
            print(event.id, event.tokens, event.finished, event.reason)
    engine.result(a).text

A step is a ``Scheduler`` plan run by an ``Executor`` (``core/scheduler.py``, ``core/executor.py``; they exchange
plain data): the scheduler decides who runs, on which blocks of the paged depth cache (``core/blocks.py``: ``kv_budget`` positions
allocated once, in blocks of ``block_size``; prompt blocks shared across requests), under a per-step token budget
(``max_step_tokens``; prompt blocks whole, or in depth slices when less than a block is left), preempting the most recently admitted request when blocks run out; the executor drafts and
verifies every running request in one full-depth pass; the scheduler applies the stop rules and emits the events.

Lossless and batch-invariant.  A request reads and writes only its own rows (its blocks, and shared prompt blocks
whose rows are the ones it would have computed); its prompt is prefilled block by block, each block its own
attention segment; its initial states depend only on ``state_seed``, ``init_scale`` and position and its sampling
noise only on ``seed`` and position; a preempted request's rows come back bit for bit.  So its tokens are those of
its own batch-1 AR decode whatever else runs, joins, leaves, shares or is cancelled - in float32, where the batched
products give each row the value it has alone (tests check it); in bfloat16 a batched product may round a row
differently from a batch of one, so tokens can differ at near-ties (paper sec. B.3; docs/architecture.md).  How
much the engine speculates may change per step (``SpeculationPolicy``): every method emits the same tokens.

Threads: one thread steps the engine; ``add``, ``cancel`` and ``step`` are called from it (the server's worker).
"""

from __future__ import annotations

import copy
import itertools
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable, Iterator


from ...model.cache import bytes_per_token
from ...model.looped import LoopedLM
from ...model.memory import available_memory, reset_peak_memory
from ..base.contract import Status, StepPlan, StopReason
from ..base.request import pool_share, rows_needed
from ..base.runtime import DEFAULT, Runtime
from ..core.blocks import BLOCK_SIZE, BlockPool, call_rows, prefix_salt, ring_blocks
from ..core.drafters import DrafterCache
from ..core.executor import Executor
from ..core.policy import SpeculationPolicy
from ..core.remote import RemoteExecutor
from ..core.scheduler import Entry, Scheduler
from ..core.stopping import Criterion, StopRule
from ..drafting.draft import Drafter
from .options import GenerationResult, as_token_list, default_stop_ids, sampling_options, split_stop
from .output import OutputProcessor, StepEvent

__all__ = ["Engine", "StepEvent", "default_kv_budget"]

MAX_STEP_TOKENS = 512      # rows one step may verify and prefill together (docs/performance-journal.md, "Head-of-line")
# ... in a closed batch (``generate_batch``), where no request waits on another's first token: the prefill in
# fewer steps, at most the rows a product keeps its per-row rate at (docs/performance-journal.md, "A closed
# batch's step budget")
CLOSED_STEP_TOKENS = 1024
MEMORY_SHARE = 0.5         # the default pool: at most this share of the free device memory


def default_kv_budget(model: LoopedLM, R: int, max_batch: int, width: int, block_size: int = BLOCK_SIZE,
                      window: int | None = None) -> int:
    """``max_batch`` requests of the whole context (``pool_share`` each), or as many positions as ``MEMORY_SHARE``
    of the free memory holds, whichever is less (a larger request is then refused with a message naming
    kv_budget)."""
    ctx = model.config.block_size
    want = max_batch * pool_share(ctx, 0, ctx, width, block_size)
    free = available_memory(model.device)
    if free is None:
        return want
    return max(1, min(want, int(MEMORY_SHARE * free // bytes_per_token(model.config, R, model.dtype, window))))


class Engine:
    def __init__(self, model: LoopedLM, method: str = "ar", knobs: dict | None = None, *,
                 num_steps: int | None = None, runtime: Runtime | None = None, max_batch: int = 8,
                 kv_budget: int | None = None, block_size: int = BLOCK_SIZE, max_step_tokens: int = MAX_STEP_TOKENS,
                 policy: SpeculationPolicy | None = None, tokenizer=None, drafter: Drafter | None = None,
                 drafters: DrafterCache | None = None, closed: bool = False, executor: str = "local",
                 overlap: bool = False, window_kv: bool = True):
        """``closed``: every request is added before the first step and the caller takes the results together
        (generate_batch) - drafters that weigh speed then plan for the batch's end (``DraftContext.closed``); a
        server leaves it False.  ``executor``: "local" (in this process) or "process" (the model, its cache and
        the drafters in a child process fed by plans: ``core/remote.py``; call ``close`` when done).  ``overlap``: plan
        step n + 1 while step n executes (on the executor's thread, or in its process) and process step n's
        outputs while step n + 1 does - the plan counts on what step n surely does (its prompt rows; at least one
        token of each decoding request) and backs the most it may commit; a request that step n ends runs one
        wasted step whose tokens are dropped.  The tokens are the same; ``step`` returns each step's events one call
        later.  ``window_kv``: on a model whose depths r >= 2 read their own K/V within a window (IQuest-Loop), keep
        only the window's rows of those depths (a ring per request, on top of ``kv_budget``; prompt blocks shared
        with their window's rows copied into the rings, no ``PrefixCache``, and a draft reads the prefix at its own
        depth: ``core/blocks.py``); False keeps every depth of every row."""
        if executor not in ("local", "process"):
            raise ValueError(f"executor must be 'local' or 'process', got {executor!r}")
        for name, v in (("overlap", overlap), ("window_kv", window_kv)):
            if not isinstance(v, bool):
                raise ValueError(f"{name} must be True or False, got {v!r}")
        self.overlap = overlap
        self._inflight: StepPlan | None = None  # overlap: the plan the executor runs next
        self._pending = None                    # overlap: an applied step's outputs, processed beside the next
        self._host: ThreadPoolExecutor | None = None   # overlap: the thread of the engine's own work
        for name, v in (("max_batch", max_batch), ("block_size", block_size), ("max_step_tokens", max_step_tokens)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a whole number >= 1, got {v!r}")
        self.model = model
        self.R = model.depth(num_steps)
        self.runtime = runtime or DEFAULT
        self.runtime.primitives(model)                        # what the runtime needs (CUDA graphs: CUDA) fails here
        self.max_batch = max_batch
        self.tokenizer = tokenizer or model.tokenizer
        if drafters is None:
            drafters = DrafterCache.of_registry(model, self.R)
        elif drafters.model is not model or drafters.R != self.R:
            raise ValueError("the drafter cache was built for another model or depth")
        self.drafters = drafters
        if drafter is not None:                               # a built drafter as the default (generate_batch)
            if knobs or method not in ("ar", drafter.name):
                raise ValueError("give either a drafter or a method and its knobs, not both")
            self.method, self.knobs, self._default = drafter.name, {}, drafter
        else:
            self.method, self.knobs = method, dict(knobs or {})
            self._default = self.drafter(method, self.knobs)  # the default method's knobs fail here, not later
        d = self._default
        window = model.family.kv_window(model.config) if window_kv and self.R > 1 else None
        ring = ring_blocks(window, self.R, block_size, call_rows(block_size, d.width))
        if ring * block_size >= (self.R - 1) * model.config.block_size:
            window, ring = None, 0                            # a ring as long as the context saves nothing
        self.window = window
        if kv_budget is None:
            kv_budget = default_kv_budget(model, self.R, max_batch, d.width, block_size, self.window)
        kv_budget += max_batch * block_size * ring            # the running requests' rings, on top
        if self.runtime.track_memory:
            reset_peak_memory(model.device)
        self._prefix_caches: dict[int, object] = {}         # by id: what a plan's prefix-cache copies name
        self._prefix_users: Counter[int] = Counter()         # requests not yet finished that use each
        self.remote = executor == "process"
        if self.remote:                                      # the books here, the rows in the executor's process
            self.pool = BlockPool.accounting(kv_budget, block_size,
                                             bytes_per_token(model.config, self.R, model.dtype, self.window),
                                             self.R, self.window)
            self.executor = RemoteExecutor(model, self.R, kv_budget, block_size, self.runtime, self.window)
        else:
            self.pool = BlockPool(model, self.R, kv_budget, block_size, self.window)
            self.runtime.prepare_cache(self.pool.tensors())
            self.executor = Executor(model, self.R, self.pool, self.runtime, self.drafters, self._prefix_caches)
        self.scheduler = Scheduler(self.pool, max_batch, max_step_tokens, policy, R=self.R, closed=closed)
        self.output = OutputProcessor(model.device, self.runtime.track_memory, self.pool.bytes_per_block)
        self.output.sync = not overlap         # a finishing request's wall time must not wait for the step in flight
        self._ids = itertools.count()
        self._table: dict[int, Entry] = {}
        self._results = self.output.results
        self._release: list[int] = []          # ended since the last plan: the executor drops their state
        self.host_seconds = 0.0                # time in the engine's own work (planning, applying, outputs)
        self.execute_seconds = 0.0             # time waiting for the executor (in process: running it)
        self._events: list[StepEvent] = []     # this step's events so far (kept if the step raises: take_events)

    # --- requests -----------------------------------------------------------------------------------------
    def drafter(self, method: str, knobs: dict | None = None, sampled: bool = False) -> Drafter:
        """The engine's drafter for (method, knobs, greedy or sampled), built and validated on first use and then
        shared by every request that asks for it (its cross-request state: Token Recycling's table)."""
        return self.drafters.get(method, knobs, sampled)

    @property
    def waiting(self) -> list[Entry]:
        return list(self.scheduler.waiting)

    @property
    def running(self) -> list[Entry]:
        return list(self.scheduler.running)

    @property
    def steps(self) -> int:
        return self.scheduler.steps

    def add(self, prompt, *, max_new_tokens: int = 256, stop: Iterable[int | str] | None = None, eos: bool = True,
            seed: int = 0, state_seed: int = 0, init_scale: float = 1.0, do_sample: bool = False,
            temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
            min_p: float | None = None, stopping_criteria: Iterable[Criterion] | None = None, streamer=None,
            prefix_cache=None, method: str | None = None, knobs: dict | None = None, drafter: Drafter | None = None,
            timeout: float | None = None, trace: bool = False, tokenizer=None,
            exit_threshold: float | None = None, exit_at_step: int | None = None) -> int:
        """Queue a request; returns its id.  Every option is checked here (a request that can never run - longer
        than the context, larger than the whole pool - is refused now, not when it would start).  ``seed`` seeds
        the sampling noise; ``state_seed`` and ``init_scale`` the latent initial states (Huginn, Raven), so sampled
        requests with different seeds share prompt blocks.  ``exit_threshold`` / ``exit_at_step``: the target's
        early exit (Ouro; ``dasspec/model/exit.py``)."""
        for name, v in (("seed", seed), ("state_seed", state_seed)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"{name} must be an integer, got {v!r}")
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
        if not (isinstance(init_scale, (int, float)) and init_scale >= 0 and init_scale == init_scale):
            raise ValueError(f"init_scale must be a finite number >= 0, got {init_scale!r}")
        if prefix_cache is not None and self.window:
            raise ValueError("this engine keeps only the window's rows of the model's depths >= 2 (window_kv): a "
                             "prefix cache cannot hold them; build the engine with window_kv=False to use one")
        if prefix_cache is not None:
            prefix_cache.check(self.model, self.R, init_scale, state_seed, self.pool.B, exit, self.runtime)
        if timeout is not None and not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ValueError(f"timeout must be a number of seconds > 0, got {timeout!r}")
        salt = prefix_salt(self.R, init_scale, state_seed, exit, self.model.dtype, self.pool.B)
        key = self.drafters.key_of(drafter)
        if self.remote and (key.handle is not None or prefix_cache is not None):
            raise ValueError("an engine whose executor runs in another process builds its drafters from a method and "
                             "knobs and holds no prefix cache: pass method= and knobs=, not a drafter object or "
                             "prefix_cache")
        if prefix_cache is not None:
            self._prefix_caches[id(prefix_cache)] = prefix_cache
            self._prefix_users[id(prefix_cache)] += 1
        e = Entry(next(self._ids), ids, rule, drafter, key,
                  rows_needed(ctx, P, rule.max_new_tokens, drafter.width), salt,
                  None if timeout is None else time.monotonic() + timeout, init_scale=float(init_scale),
                  state_seed=int(state_seed), sampling=sampling, exit=exit, trace=trace, prefix_cache=prefix_cache)
        self.scheduler.add(e)
        self.output.add(e, drafter.name, streamer, tok.decode if tok is not None else None)
        self._table[e.id] = e
        return e.id

    def cancel(self, rid: int) -> None:
        """Stop request ``rid`` at the next step (or the next drafting round): what it committed stays."""
        e = self._table.get(rid)
        if e is None:
            raise KeyError(f"no request {rid}")
        e.cancelled = True
        self.executor.cancel(rid)

    def result(self, rid: int) -> GenerationResult:
        """The finished request's result (and its row leaves the table)."""
        if rid in self._results:
            self._table.pop(rid, None)
            return self._results.pop(rid)
        raise KeyError(f"request {rid} is not finished" if rid in self._table else f"no request {rid}")

    def discard(self, rid: int) -> None:
        """Forget a finished request's result without reading it (a server whose client is gone)."""
        self._results.pop(rid, None)
        self._table.pop(rid, None)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self._inflight is not None or self._pending is not None

    def cache_usage(self) -> dict[str, int]:
        """Blocks held, cached for sharing and in all; requests preempted so far (read from another thread: a
        snapshot, not a consistent one)."""
        p = self.pool
        return {"used": p.in_use, "cached": p.cached, "total": p.capacity_blocks,
                "preemptions": self.scheduler.preemptions}

    # --- the step ---------------------------------------------------------------------------------------------
    def step(self) -> list[StepEvent]:
        """Plan, execute, apply: the events of this step (with ``overlap``: of the step that just finished, the next
        one already running).  If the step raises, the events it had made are kept for ``take_events``; call
        ``abort_running`` to end the requests whose states the failure left untrusted."""
        if self.overlap:
            return self._step_overlapped()
        t0 = time.perf_counter()
        plan = self._plan(inflight=False)
        if not plan.empty:
            t1 = time.perf_counter()
            out = self.executor.execute(plan)
            t2 = time.perf_counter()
            self.execute_seconds += t2 - t1
            t0 += t2 - t1
            self._process(*self._apply(plan, out))
        self._idle()
        self.host_seconds += time.perf_counter() - t0
        return self.take_events()

    def _step_overlapped(self) -> list[StepEvent]:
        """One step of the pipeline: the executor runs the step in flight on this thread (or in its process) while
        the engine's own work - the last step's outputs (events, streamers: they run on the engine's host thread),
        then the next plan - runs on the host thread; then the step's output is applied.  (The model stays on the
        caller's thread: a second thread running torch ops would bring a second OpenMP team, and two teams spinning
        on the same cores slowed every step down on a 2-core CPU.)"""
        t0 = time.perf_counter()
        if self._inflight is None:                    # the pipeline's first step (or after it drained)
            plan = self._plan(inflight=False)
            if plan.empty:
                self._idle()
                self.host_seconds += time.perf_counter() - t0
                return self.take_events()
            self._inflight = plan
        if self._host is None:
            self._host = ThreadPoolExecutor(1, thread_name_prefix="dasspec-engine")
        done, self._inflight = self._inflight, None
        # the executor's own copy of the plan (the remote executor pickles it), taken before the host thread plans on
        plan = done if self.remote else copy.deepcopy(done)
        pending, self._pending = self._pending, None
        job = self._host.submit(self._host_work, pending)
        t1 = time.perf_counter()
        try:
            out = self.executor.execute(plan)
        except BaseException:
            self.execute_seconds += time.perf_counter() - t1
            self._host_failed(job)
            raise
        t2 = time.perf_counter()
        self.execute_seconds += t2 - t1
        t0 += t2 - t1
        try:
            nxt = job.result()
        except BaseException:                         # the step ran: its outcome is applied, then the error raised
            self._process(*self._apply(done, out))
            raise
        self._pending = self._apply(done, out)
        self._drop_unused_caches()                    # (the executor is done with the plan that named them)
        if not nxt.empty:
            self._inflight = nxt
        else:                                         # drained: nothing to overlap the outputs with
            self._process(*self._pending)
            self._pending = None
            self._idle()
        self.host_seconds += time.perf_counter() - t0
        return self.take_events()

    def _host_failed(self, job) -> None:
        """The step failed: the plan made beside it never runs - what it assumed is forgotten, the requests it
        started go back to the queue and the ids it was to release wait for the next plan."""
        try:
            nxt = job.result()
        except BaseException:                         # noqa: BLE001 - the step's own error is the one raised
            return
        self.scheduler.withdraw(nxt)
        self._release[:0] = nxt.release

    def _host_work(self, pending) -> StepPlan:
        if pending is not None:
            self._process(*pending)
        return self._plan(inflight=True)

    def _plan(self, inflight: bool) -> StepPlan:
        """The scheduler's next plan, with the ids to release; the requests it ended first are finished now."""
        plan, ended = self.scheduler.schedule()
        for e in ended:
            self._events.append(self._finish(e))
        self._events += self.output.started([self._table[s.id] for s in plan.start])
        progress = plan.rows or plan.swap_in or any(w.prefill is None and w.room for w in plan.work)
        if not progress and not plan.start and not ended and self.scheduler.has_work and not inflight:
            raise RuntimeError("the engine planned a step that moves no request (a scheduler bug): "
                               f"running {[(e.id, e.computed, len(e.generated)) for e in self.scheduler.running]}, "
                               f"waiting {len(self.scheduler.waiting)}")
        plan.release, self._release = self._release, []
        return plan

    def _apply(self, plan: StepPlan, out) -> tuple:
        """Apply a step's output to the scheduler; returns what ``_process`` turns into events and streams."""
        self.output.measured(out)
        committed, finished = self.scheduler.update(plan, out)
        return committed, finished, self.scheduler.stopped()

    def _process(self, committed, finished, stopped) -> None:
        """Events and streamers of an applied step: its tokens, then the requests that ended (by their stop rule,
        or failed, cancelled, out of time)."""
        self._events += self.output.committed(committed, finished)
        for e in finished + stopped:
            self._events.append(self._finish(e))

    def _idle(self) -> None:
        """Nothing more to run: the executor drops the ended requests' state now, and unused prefix caches go."""
        if self._release and not self.scheduler.has_work:
            self.executor.execute(StepPlan(self.scheduler.steps, release=self._release))
            self._release = []
        self._drop_unused_caches()

    def _drop_unused_caches(self) -> None:
        """Forget the prefix caches no unfinished request uses - only between executions (a plan in flight may
        still name one whose last request ended meanwhile, on the host thread)."""
        for key in [k for k, n in self._prefix_users.items() if n <= 0]:
            del self._prefix_users[key], self._prefix_caches[key]

    def close(self) -> None:
        """End the executor's process (``executor="process"``) and the host thread (``overlap``).  Requests still
        running are left as they are (a step in flight under ``overlap`` is not run): step until ``has_work`` is
        False first to finish them."""
        if self._host is not None:
            self._host.shutdown(wait=True)
            self._host = None
        self.executor.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def take_events(self) -> list[StepEvent]:
        """The events made since the last ones returned (after a step raised: what it had done before)."""
        events, self._events = self._events, []
        return events

    def run(self) -> Iterator[StepEvent]:
        """Step until every request has finished, yielding the events."""
        while self.has_work:
            yield from self.step()

    def abort_running(self, reason: StopReason = StopReason.ERROR) -> list[int]:
        """End every running (and swapped-out) request now - after a step failed, their states cannot be trusted;
        returns their ids.  Their blocks go back to the pool; requests not yet started stay queued."""
        ids = []
        self.scheduler.drop_holds()                  # (what the failed step was to copy is not trusted either)
        for e in self.scheduler.running + [x for x in self.scheduler.waiting if x.status is Status.SWAPPED]:
            self.scheduler._end(e, reason)
            self._events.append(self._finish(e))
            ids.append(e.id)
        if not self.scheduler.has_work:              # no next plan would carry their release: send it now
            try:
                self._idle()
            except Exception:                        # noqa: BLE001 - an executor that failed may fail this too;
                pass                                 # the states it held go with it
        return ids

    def _finish(self, e: Entry) -> StepEvent:
        """A request ended: its result is kept until ``result`` (or ``discard``) is called; the executor drops its
        state with the next plan."""
        self._release.append(e.id)
        if e.prefix_cache is not None:
            key = id(e.prefix_cache)
            self._prefix_users[key] -= 1               # (dropped between executions: _drop_unused_caches)
        return self.output.finish(e)
