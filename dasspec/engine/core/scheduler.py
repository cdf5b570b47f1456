"""The scheduler: the table of requests, the block pool's bookkeeping and the plan of every step - plain data for
the executor (``executor.py``), which runs it and answers with plain data.

    plan, ended = scheduler.schedule()     # StepPlan: who starts, who is swapped out / in, per request its work
    out = executor.execute(plan)           # StepOutput: per request, committed tokens and counts
    committed, finished = scheduler.update(plan, out)   # stop rules, blocks back to the pool

Each step: requests cancelled or past their deadline end; every running request that decodes gets the blocks its
verification may write (its anchor plus its drafter's ``width`` of scratch; just the anchor when the step's draft cap
is 0, or when only its own preemption could free the scratch: it takes an AR step) - oldest first, and when blocks
run out the most recently admitted request is preempted (its rows are swapped
to host memory, bit for bit, and it resumes later with exactly the tokens it would have produced); then prompt
blocks are prefilled under what is left of the step's token budget (``max_step_tokens``): requests still prefilling
first, then waiting ones, first in first out, each admitted only while a batch slot and the blocks of its whole
prompt are free (so it never rolls itself back); one whose prompt does not fit yet lets up to ``max_batch``
requests behind it start meanwhile, then is served first.  A swapped-out request comes back with its next draft's
rows, or its anchor's alone when they do not fit (AR steps, as above).  The budget decides when a block runs,
never where a prompt is cut: chunk boundaries are block boundaries.  When what is left is less than the next
block, the block runs a depth slice instead - core steps (r0, r1] of its R, as many as the budget's rows buy (a
block of b rows at d of R depths costs ceil(b d / R)), carried over the next steps until its R-th: a looped
model's prefill splits along depth as well as along positions, and the rows are the same whichever steps compute
them (each core step reads the prefix at its own depth, computed before).  A request whose prompt +
max_new_tokens could never fit the pool alone is refused by ``add``.

Prompt blocks shared with earlier requests (``blocks.py``) are looked up at admission and skipped.  On a model whose
depths r >= 2 are windowed (IQuest-Loop) each request holds, besides its blocks, a ring per windowed depth from its
admission (or swap-in) to its end (or swap-out), and prefills a step only the rows its rings hold beside the window
before them (at least ``WINDOW_PREFILL_ROWS``; its whole prompt where its rings never wrap).  A step that completes
prompt blocks there also keeps their rings' rows (in blocks taken after everything else is planned, while one free
block per running request is left), and a request admitted onto shared blocks has the window's rows before them
copied into its rings; a plan holds both kinds of block until its outcome is applied (``_holds``).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

from ...model.cache import CacheCapacityError
from ...model.exit import ExitRule
from ..base.contract import DrafterKey, StartRequest, Status, StepOutput, StepPlan, StopReason, Work
from ..base.sampling import Sampling
from ..drafting.draft import Drafter
from .blocks import BlockPool, block_keys, call_rows, window_blocks, window_key
from .policy import SpeculationPolicy
from .stopping import StopRule


class Held(NamedTuple):
    """The blocks a plan of a pool with windowed depths holds until its outcome is applied: the shared blocks a
    starting request's rings copy from (by request), and the blocks prompt rows are kept in (request, key, block) -
    registered once the step ran."""

    borrowed: dict[int, list[int]]
    kept: list[tuple[int, bytes, int]]


# --- the table -------------------------------------------------------------------------------------------------
@dataclass(eq=False)
class Entry:
    """A row of the scheduler's table: one request from ``add`` to its result."""

    id: int
    prompt: list[int]
    rule: StopRule
    drafter: Drafter                   # for its width and reach; the executor is told its ``key``
    key: DrafterKey
    max_rows: int                      # rows it may ever hold (prompt + max_new_tokens + the drafter's scratch)
    salt: bytes                        # what decides its prompt rows besides the tokens (block keys)
    deadline: float | None
    init_scale: float = 1.0
    state_seed: int = 0
    sampling: Sampling | None = None
    exit: ExitRule | None = None
    trace: bool = False
    prefix_cache: object = None        # a PrefixCache (the plan names it by its id)
    status: Status = Status.WAITING
    blocks: list[int] = field(default_factory=list)
    ring: list[int] = field(default_factory=list)   # its windowed depths' rings (``blocks.py``), while running
    ring_need: int = 0                 # blocks of its rings for its drafts (0: the model has no windowed depths)
    ring_least: int = 0                # ... for AR steps (what it takes when the rings for its drafts do not fit)
    peak_blocks: int = 0               # the most blocks it held at once (rings included)
    cached: int = 0                    # prompt rows it started with (shared blocks and prefix-cache copies)
    keys: list[bytes] = field(default_factory=list)   # its full prompt blocks' keys
    computed: int = 0                  # prompt rows materialised (shared ones included)
    depth_done: int = 0                # core steps done of the block after ``computed`` (a depth slice in flight)
    generated: list[int] = field(default_factory=list)   # committed tokens, after the stop rule
    cancelled: bool = False
    reason: StopReason | None = None
    error: Exception | None = None     # what failed it (reason "error"): its streamer, its setup
    passed: int = 0                    # requests admitted past it while its prompt did not fit the free blocks
    # per step planned and not yet applied (a plan made while a step runs: ``Engine(overlap=True)``): prompt rows it
    # computes, and the fewest and most tokens it may commit - what the next plan assumes of it
    flight: dict[int, tuple[int, int, int]] = field(default_factory=dict)

    @property
    def P(self) -> int:
        return len(self.prompt)

    @property
    def n(self) -> int:
        """Verified rows: the prompt, then every committed token but the last (the anchor)."""
        return self.computed if not self.generated else self.P + len(self.generated) - 1

    # What a plan may count on while earlier steps are in flight (all equal to the applied values when none is):
    @property
    def computed_ahead(self) -> int:
        """Prompt rows materialised once the steps in flight are done (prefill always completes)."""
        return self.computed + sum(p for p, _, _ in self.flight.values())

    @property
    def decoding(self) -> bool:
        """It has emitted its first token, or a step in flight will."""
        return bool(self.generated) or any(lo for _, lo, _ in self.flight.values())

    @property
    def n_ahead(self) -> int:
        """The most verified rows it may hold once the steps in flight are done (each may commit its most)."""
        if not self.decoding:
            return self.computed_ahead
        return self.P + len(self.generated) + sum(hi for _, _, hi in self.flight.values()) - 1

    @property
    def n_least(self) -> int:
        """The fewest verified rows a decoding request holds once the steps in flight are done."""
        return self.P + len(self.generated) + sum(lo for _, lo, _ in self.flight.values()) - 1

    @property
    def left(self) -> int:
        """Tokens max_new_tokens surely leaves once the steps in flight are done (each commits at least its
        fewest)."""
        return self.rule.max_new_tokens - len(self.generated) - sum(lo for _, lo, _ in self.flight.values())

    def stopping(self) -> str | None:
        """Why it must stop now (failed, cancelled, out of time), or None: asked between steps and drafting
        rounds."""
        if self.error is not None:
            return StopReason.ERROR
        if self.cancelled:
            return StopReason.CANCELLED
        if self.deadline is not None and time.monotonic() > self.deadline:
            return StopReason.TIMEOUT
        return None


class Committed(NamedTuple):
    """What a step committed for one request after its stop rule: the tokens kept, and its verification event
    (proposals, accepted and kept, the target's token kept) when it verified a draft."""

    entry: Entry
    tokens: list[int]
    event: tuple[int, int, bool] | None


class Scheduler:
    def __init__(self, pool: BlockPool, max_batch: int, max_step_tokens: int,
                 policy: SpeculationPolicy | None = None, R: int | None = None, closed: bool = False):
        """``R``: the depth, for depth slices of prompt blocks (None: whole blocks only).  ``closed``: the caller
        added every request up front and takes the results together (generate_batch), so once none waits the batch
        is done when its longest request is (``StepPlan.closed``)."""
        self.pool, self.max_batch, self.max_step_tokens, self.R = pool, max_batch, max_step_tokens, R
        self.closed = closed
        if policy is not None and not isinstance(policy, SpeculationPolicy):
            raise TypeError(f"policy must be a SpeculationPolicy (how much to speculate), got {policy!r}; a drafter's "
                            "prefix-read policy is a knob of its method")
        self.policy = policy or SpeculationPolicy()
        self.waiting: deque[Entry] = deque()       # swapped-out requests first, then new ones, FIFO
        self.running: list[Entry] = []             # in admission order (the last is preempted first)
        self.steps = 0
        self.preemptions = 0
        self.prefilled_rows = 0                    # prompt rows computed (not shared)
        self.shared_rows = 0                       # prompt rows taken from shared blocks
        self._holds: dict[int, Held] = {}          # by plan not yet applied (windowed depths)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, e: Entry) -> None:
        B = self.pool.B
        rows = e.P + e.rule.max_new_tokens        # alone, it can always decode (AR steps when drafts do not fit)
        e.ring_need = self.pool.ring_blocks(call_rows(B, e.drafter.width), e.max_rows)
        e.ring_least = self.pool.ring_blocks(call_rows(B, 0), e.max_rows)
        if self.pool.blocks_for(rows) + e.ring_least > self.pool.capacity_blocks:
            rings = f" and {e.ring_least} blocks of windowed-depth rings" if e.ring_least else ""
            raise CacheCapacityError(
                f"the request needs up to {rows} cache positions (prompt {e.P} + max_new_tokens "
                f"{e.rule.max_new_tokens}){rings} but the engine's pool holds {self.pool.describe()}; lower "
                "max_new_tokens or raise kv_budget")
        e.keys = block_keys(e.prompt, B, e.salt, e.P // B)
        self.waiting.append(e)

    # --- planning ----------------------------------------------------------------------------------------
    def schedule(self) -> tuple[StepPlan, list[Entry]]:
        """The next step's plan, and the entries that ended before it (cancelled, out of time)."""
        ended = []
        for e in list(self.waiting) + list(self.running):
            reason = e.stopping()
            if reason is not None:
                self._end(e, reason)
                ended.append(e)
        self.steps += 1
        plan = StepPlan(self.steps)
        B, budget = self.pool.B, self.max_step_tokens
        decoding = [e for e in self.running if e.decoding]
        cap = self.policy.cap(len(decoding))
        planned: dict[int, Work] = {}
        for e in list(self.running):                      # decoding requests first, oldest first
            if e.status is not Status.RUNNING or not e.decoding or e.left <= 0:
                continue                                  # (no tokens left: it ends when the step in flight is applied)
            n = e.n_ahead
            c = 0 if len(e.ring) < e.ring_need else cap    # rings for AR steps only: AR steps
            width = 0 if c == 0 else e.drafter.width
            reach = getattr(e.drafter, "reach", None) or 0
            if e.ring:                                    # a longer chain only as far as its rings hold
                reach = min(reach, call_rows(B, e.drafter.width) - 1)
            keep = None
            if reach > e.drafter.width:                   # last step's longer scratch is handed back first
                k = self.pool.blocks_for(min(n + 1 + e.drafter.width, e.max_rows))
                if len(e.blocks) > k:
                    self.pool.free(e.blocks[k:])
                    e.blocks, keep = e.blocks[:k], k
            got = None
            if c != 0 and reach > width:                  # a longer chain, if free blocks allow (no preemption)
                got = self._grow(e, min(n + 1 + reach, e.max_rows), plan, planned, preempt=False)
                width = reach if got is not None else width
            if got is None:
                got = self._grow(e, min(n + 1 + width, e.max_rows), plan, planned, spare=width > 0)
            if got is None and e.status is Status.RUNNING:    # only itself left to preempt: an AR step, no scratch
                c, width = 0, 0
                got = self._grow(e, n + 1, plan, planned)
            if got is None:
                continue                                  # preempted itself
            planned[e.id] = w = Work(e.id, got, room=e.left, cap=c, keep=keep)
            plan.work.append(w)
            budget -= max(1, min(width, e.drafter.width))   # its verifier inputs (a longer reach is backed, not charged)
        for e in list(self.running):                      # then prompts still prefilling
            if e.status is Status.RUNNING and not e.decoding and e.computed_ahead < e.P:
                budget = self._prefill(e, budget, plan, planned)
        # (from the applied rows: a block a step in flight computes is claimed too - it is registered once applied)
        claimed = {k for x in self.running if x.computed < x.P for k in x.keys[x.computed // B:]}
        held: list[Entry] = []                            # waiting requests passed this step (their prompt did not fit)
        for e in list(self.waiting):                      # first in, first served (for memory)
            if len(self.running) >= self.max_batch:
                break
            if e.status is Status.SWAPPED:
                if e.flight or not self._swap_in(e, plan, planned):
                    break                                 # (swapped out beside its step in flight: back once applied)
                continue
            if plan.rows and (budget <= 0 if self._sliced(e) else budget < B):   # it would only hold blocks
                break
            usable = (e.P - 1) // B
            hit = self.pool.cached_run(e.keys[:usable])
            if hit < min(usable, len(e.keys)) and e.keys[hit] in claimed:   # its next block is being computed:
                continue                                                  # share it next step
            if any(x.passed >= self.max_batch for x in held):
                break
            refused = self._admit(e, budget, plan, planned)
            if refused is not None:
                if refused == "full" or e.passed >= self.max_batch:
                    break                                 # the pool is full, or it has waited long enough: FIFO
                held.append(e)                            # its prompt needs more blocks than are free: smaller
                continue                                  # requests behind it may start meanwhile (a bounded number)
            for x in held:
                x.passed += 1
            budget = self._prefill(e, budget, plan, planned)
            if e.status is not Status.RUNNING:           # it preempted itself: the pool is full for now
                break
            claimed.update(e.keys[e.computed // B:])
        # closed once nobody waits for a slot and every running request decodes (a prompt still prefilling is the
        # batch's end, and the drafters do not see it)
        plan.closed = self.closed and not self.waiting and all(e.decoding for e in self.running)
        if self.pool.window:
            self._keep_window(plan)
        self._assume(plan)
        return plan, ended

    def withdraw(self, plan: StepPlan) -> None:
        """A plan made beside a step that failed is never run: what it assumed is forgotten, and the requests it
        started go back to the head of the queue (nothing of theirs was computed)."""
        for e in list(self.running) + list(self.waiting):
            e.flight.pop(plan.step, None)
        running = {x.id: x for x in self.running}
        for s in reversed(plan.start):
            if s.id in running:
                self._unstart(running[s.id], plan.step)
        self._release_holds(plan.step)

    def drop_holds(self) -> None:
        """Return the blocks every plan not applied holds, nothing registered (a step failed: ``abort_running``)."""
        for step in list(self._holds):
            self._release_holds(step)

    def _release_holds(self, step: int, out: StepOutput | None = None) -> None:
        """The blocks plan ``step`` held back to the pool; with its output, the kept prompt rows of the requests
        whose prefill ran registered first."""
        borrowed, kept = self._holds.pop(step, Held({}, []))
        for blocks in borrowed.values():
            self.pool.free(blocks)
        failed = {rid for rid, _ in out.failed} if out is not None else set()
        for rid, key, block in kept:
            o = out.requests.get(rid) if out is not None else None
            if o is not None and o.prefilled and rid not in failed:
                self.pool.register(block, key)
            self.pool.free([block])

    def _hold(self, step: int) -> Held:
        return self._holds.setdefault(step, Held({}, []))

    def _keep_window(self, plan: StepPlan) -> None:
        """Blocks for the rows at every windowed depth of the prompt blocks this plan completes (not cached yet),
        while one free block per running request is left: their rings' rows are copied there after the step."""
        pool, B, running = self.pool, self.pool.B, {x.id: x for x in self.running}
        planned: set[bytes] = set()
        for w in plan.work:
            e = running.get(w.id)
            if e is None or w.prefill is None or (w.depths is not None and w.depths[1] != self.R):
                continue
            a, b = w.prefill
            for q in range(a // B, min(b // B, len(e.keys))):
                for r in range(2, pool.R + 1):
                    key = window_key(e.keys[q], r)
                    if key in planned or pool.cached_run([key]):
                        continue
                    if pool.available <= len(self.running):
                        return
                    block = pool.allocate(1, tail=True)[0]     # (out of the runs sequences grow in)
                    w.keep_window.append((r, q, block))
                    self._hold(plan.step).kept.append((e.id, key, block))
                    planned.add(key)

    def _assume(self, plan: StepPlan) -> None:
        """Record per request what the plan will do that the next plan may count on before this one's outcome is
        applied: prompt rows (a prefill always completes), and the fewest and most tokens it may commit (a decoding
        step: at least one, at most what its room and its blocks allow; a prompt's last block: its first token)."""
        B, running = self.pool.B, {x.id: x for x in self.running}
        for w in plan.work:
            e = running.get(w.id)
            if e is None:
                continue
            if w.prefill is not None:
                a, b = w.prefill
                complete = w.depths is None or w.depths[1] == self.R
                rows = b - a if complete else 0
                first = 1 if complete and b == e.P else 0
                e.flight[plan.step] = (rows, first, first)
            else:
                # the most it may commit: what its blocks back past the fewest rows it may hold when the step runs
                e.flight[plan.step] = (0, 1, max(1, min(w.most, len(e.blocks) * B - e.n_least)))

    def _grow(self, e: Entry, rows: int, plan: StepPlan, planned: dict, spare: bool = False,
              preempt: bool = True) -> list[int] | None:
        """Blocks so that ``e`` holds ``rows`` rows, preempting the most recently admitted requests if needed;
        None if ``e`` itself was preempted (or, with ``spare``, would have been: it is not; without ``preempt``,
        if the free blocks do not suffice)."""
        need = self.pool.blocks_for(rows) - len(e.blocks)
        if need <= 0:
            return []
        while True:
            got = self.pool.allocate(need, after=e.blocks[-1] if e.blocks else None)
            if got is not None:
                e.blocks += got
                return got
            if not preempt:
                return None
            victim = self.running[-1]
            if victim is e and spare:
                return None
            self._preempt(victim, plan, planned)
            if victim is e:
                return None

    def _preempt(self, e: Entry, plan: StepPlan, planned: dict) -> None:
        """Swap ``e`` out: its verified rows go to host memory (the executor copies them before anything else
        of the step runs), its blocks back to the pool; it waits at the head of the queue."""
        self.preemptions += 1
        w = planned.pop(e.id, None)
        if w is not None:
            plan.work.remove(w)
        started = [s for s in plan.start if s.id == e.id]
        if started:                            # admitted this very step: nothing was computed, start over
            plan.start.remove(started[0])
            plan.rings.pop(e.id, None)
            self._unstart(e, plan.step)
            return
        plan.swap_out.append(e.id)              # a depth slice in flight is dropped: its block starts over
        self.pool.free(e.blocks + e.ring)
        e.blocks, e.ring, e.depth_done, e.status = [], [], 0, Status.SWAPPED
        self.running.remove(e)
        self.waiting.appendleft(e)

    def _unstart(self, e: Entry, step: int) -> None:
        """Undo an admission whose plan never ran: its blocks back, its prompt rows none, first in the queue."""
        held = self._holds.get(step)
        self.pool.free(e.blocks + e.ring + (held.borrowed.pop(e.id, []) if held else []))
        e.blocks, e.ring, e.computed, e.depth_done, e.cached, e.status = [], [], 0, 0, 0, Status.WAITING
        self.running.remove(e)
        self.waiting.appendleft(e)

    def _admit(self, e: Entry, budget: int, plan: StepPlan, planned: dict, share: bool = True) -> str | None:
        """Start ``e`` if its whole prompt (after the shared blocks) fits the free blocks now, leaving one free block
        per running request for their growth; otherwise say why not: "full" (not even its first block fits) or
        "prompt" (its first block would: requests behind it may start meanwhile, up to ``max_batch`` of them
        before it is served first).  Admitted only when its prefill fits, a request never rolls itself back (and
        is never re-admitted, re-sending its prompt to its streamer).  The window rows a shared run copies from are
        blocks it holds beside its own for a step: where they tip the balance it starts without sharing (``add``
        admits whatever fits the pool alone)."""
        B = self.pool.B
        usable = (e.P - 1) // B                    # the last prompt token is always computed (it yields logits)
        shared, window_rows = self._share(e, usable) if share else ([], [])
        copy = None
        pc = e.prefix_cache
        if pc is not None and len(shared) < usable:
            more = min(usable, pc.full_blocks(e.prompt)) - len(shared)
            if more > 0:
                copy = (id(pc), len(shared), len(shared) + more)
        first = len(shared) + (copy[2] - copy[1] if copy else 0)
        rows = min(e.P, (first + 1) * B)
        fresh = self.pool.blocks_for(rows) - len(shared)
        whole = self.pool.blocks_for(e.P) - len(shared)
        ring = self._ring_size(e, whole)
        if self.pool.available - whole - ring < len(self.running):
            why = "full" if self.pool.available - fresh - ring < len(self.running) else "prompt"
            self.pool.free(shared + [b for _, _, b in window_rows])
            return self._admit(e, budget, plan, planned, share=False) if window_rows else why
        if window_rows:
            self._hold(plan.step).borrowed[e.id] = [b for _, _, b in window_rows]
        got = self.pool.allocate(fresh, after=shared[-1] if shared else None)
        self._take_ring(e, ring, plan)
        self.waiting.remove(e)
        e.blocks = shared + got
        e.computed = first * B
        e.status = Status.RUNNING
        self.running.append(e)
        self.shared_rows += len(shared) * B
        e.cached = first * B
        plan.start.append(StartRequest(e.id, e.prompt, e.key, e.drafter.width, e.max_rows, e.rule.max_new_tokens,
                                       e.init_scale, e.state_seed, e.sampling, e.exit, e.deadline, e.trace,
                                       cached=len(shared) * B, copy=copy, window_rows=window_rows))
        planned[e.id] = w = Work(e.id, list(e.blocks))
        plan.work.append(w)
        return None

    def _share(self, e: Entry, usable: int) -> tuple[list[int], list[tuple[int, int, int]]]:
        """The cached blocks of ``e``'s longest shareable run of prompt blocks (at most ``usable``), each referenced
        once more; with windowed depths, the run's window rows too (``blocks.window_blocks``), as (depth r, prompt
        block q, block) - the longest run whose window rows are all cached."""
        pool = self.pool
        if not pool.window:
            return pool.lookup(e.keys[:usable]), []
        for j in range(pool.cached_run(e.keys[:usable]), 0, -1):
            want = [(r, q) for r in range(2, pool.R + 1) for q in window_blocks(j, pool.B, pool.window)]
            keys = [window_key(e.keys[q], r) for r, q in want]
            if pool.cached_run(keys) == len(keys):
                shared = pool.lookup(e.keys[:j])
                return shared, [(r, q, b) for (r, q), b in zip(want, pool.lookup(keys))]
        return [], []

    def _prefill(self, e: Entry, budget: int, plan: StepPlan, planned: dict) -> int:
        """Plan the next prompt blocks of ``e`` within ``budget`` rows, or a depth slice of its next block when the
        budget buys less than the block (at least one block - or, with depth slices, one row's worth of its core steps -
        when no prompt has moved yet this step, so prefill never starves behind drafts); returns what is left."""
        B, R = self.pool.B, self.R
        start = e.computed_ahead
        size = min(B, e.P - start)
        if size <= 0:
            return budget
        if e.depth_done or (self._sliced(e) and budget < size):
            if budget <= 0 and plan.rows:
                return budget
            d = min(R - e.depth_done, max(budget * R // size, -(-R // size)))   # at least one row's worth
            end, depths = start + size, (e.depth_done, e.depth_done + d)
            cost = -(-size * d // R)
        else:
            k = budget // B if budget < size or size == B else 1      # a short last block the budget covers
            if k < 1:
                if plan.rows:
                    return budget
                k = 1                             # no prompt moved yet this step: one block, whatever the drafts took
            room = self._ring_room(e, start) if e.ring else e.P
            if e.P - start > room:                # what its rings hold beside the window before the chunk
                k = min(k, room // B)
            end, depths = min(e.P, start + k * B), None
            cost = end - start
        w = planned.get(e.id)
        got = self._grow(e, end, plan, planned)
        if got is None:
            return budget
        if w is None:
            planned[e.id] = w = Work(e.id)
            plan.work.append(w)
        w.new_blocks += got
        w.prefill, w.depths = (start, end), depths
        if depths is not None:
            e.depth_done = depths[1] % R          # the block's last core step: it is complete (``update``)
        return budget - cost

    def _sliced(self, e: Entry) -> bool:
        """Whether ``e``'s prompt blocks may run as depth slices (not under an exit rule, which reads every step's
        state at once)."""
        return self.R is not None and e.exit is None

    def _swap_in(self, e: Entry, plan: StepPlan, planned: dict) -> bool:
        """Bring ``e`` back with the rows of its next draft - or, when they do not fit, of its anchor alone (its
        next steps are AR steps until the scratch fits, as on the decode path: a drafter wider than the free pool
        must not keep a request out for good), leaving one free block per running request."""
        if e.generated:
            wide = self.pool.blocks_for(min(e.n + 1 + e.drafter.width, e.max_rows))
            need = min(wide, self.pool.available - len(self.running) - e.ring_least)
            need = max(need, self.pool.blocks_for(e.n + 1))
        else:
            need = self.pool.blocks_for(max(e.computed, 1))
        ring = self._ring_size(e, need)
        if self.pool.available - need - ring < len(self.running):
            return False
        got = self.pool.allocate(need)
        self._take_ring(e, ring, plan)
        self.waiting.remove(e)
        e.blocks, e.status = got, Status.RUNNING
        self.running.append(e)
        plan.swap_in.append((e.id, list(got)))        # the plan's own list: the entry's grows later
        return True

    def _ring_size(self, e: Entry, other: int) -> int:
        """The rings ``e`` takes beside ``other`` blocks: those for its drafts when they fit (leaving one free block
        per running request), else those for AR steps."""
        return e.ring_need if self.pool.available - other - e.ring_need >= len(self.running) else e.ring_least

    def _ring_room(self, e: Entry, start: int) -> int:
        """Rows a call from row ``start`` may write to ``e``'s rings: each holds ``span`` positions apart, the
        window's rows before ``start`` among them (``PagedCache.check_ring``): at least ``blocks.WINDOW_PREFILL_ROWS``
        (how rings are sized), the rest of its prompt where its rings never wrap."""
        pool = self.pool
        span = len(e.ring) // (pool.R - 1) * pool.B
        return span - min(start, pool.window - 1)

    def _take_ring(self, e: Entry, size: int, plan: StepPlan) -> None:
        if size:
            e.ring = self.pool.allocate(size, tail=True)
            plan.rings[e.id] = list(e.ring)

    # --- applying a step's output --------------------------------------------------------------------------------
    def update(self, plan: StepPlan, out: StepOutput) -> tuple[list[Committed], list[Entry]]:
        """Apply the executor's output: prompt progress (and newly complete prompt blocks registered for
        sharing), committed tokens cut by the stop rule.  Returns what every entry committed this step and the
        entries that finished by their stop rule (``stopped`` then ends those that must stop otherwise)."""
        committed, finished = [], []
        B = self.pool.B
        self._release_holds(plan.step, out)
        running = {x.id: x for x in self.running}
        running.update((x.id, x) for x in self.waiting if plan.step in x.flight)   # swapped out by a later plan
        for e in running.values():
            e.flight.pop(plan.step, None)
        for rid, err in out.failed:
            e = running.get(rid)
            if e is not None:
                e.error = RuntimeError(err)
        for s in plan.start:                 # blocks copied from a PrefixCache are keyed once they hold the rows
            e = running.get(s.id)
            if s.copy is not None and e is not None and e.error is None and e.status is Status.RUNNING:
                for j in range(s.copy[1], min(s.copy[2], len(e.keys))):
                    self.pool.register(e.blocks[j], e.keys[j])
        for w in plan.work:
            e = running.get(w.id)
            o = out.requests.get(w.id)
            if e is None or o is None:
                continue
            if o.prefilled:
                before = e.computed // B
                e.computed += o.prefilled
                self.prefilled_rows += o.prefilled
                if e.status is Status.RUNNING:        # (swapped out since this step was planned: its blocks are gone)
                    for j in range(before, min(e.computed // B, len(e.keys))):
                        self.pool.register(e.blocks[j], e.keys[j])
            if o.tokens:
                start = len(e.generated)
                e.generated.extend(o.tokens)
                hit = e.rule.scan(e.generated, start)
                kept = len(o.tokens)
                if hit is not None:
                    keep, reason = hit
                    e.reason = StopReason(reason)
                    del e.generated[keep:]
                    kept = keep - start
                event = None
                if o.verdict is not None:
                    proposals, a, target = o.verdict
                    event = (proposals, min(a, kept), target and kept == len(o.tokens))
                committed.append(Committed(e, o.tokens[:kept], event))
                if hit is not None:
                    self._end(e, e.reason)
                    finished.append(e)
        for e in self.running:
            e.peak_blocks = max(e.peak_blocks, len(e.blocks) + len(e.ring))
        return committed, finished

    def stopped(self) -> list[Entry]:
        """End the running entries that must stop now (failed, cancelled, out of time) - those that stopped while
        drafting were not verified this step."""
        ended = []
        for e in list(self.running):
            reason = e.stopping()
            if reason is not None:
                self._end(e, reason)
                ended.append(e)
        return ended

    def _end(self, e: Entry, reason: StopReason) -> None:
        e.reason = reason
        if e.status is not Status.FINISHED:
            if e in self.running:
                self.running.remove(e)
            elif e in self.waiting:
                self.waiting.remove(e)
            self.pool.free(e.blocks + e.ring)
            e.blocks, e.ring = [], []
        e.status = Status.FINISHED
