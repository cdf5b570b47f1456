"""The executor: runs a ``StepPlan`` on the model and answers with a ``StepOutput`` (``scheduler.py``).

It holds each running request's device state (``Request``: token buffer, paged cache, initial states) and its
drafting session, and per step: copies the rows of requests swapped out to host memory, sets up the requests that
start (their shared prompt blocks already hold rows) and restores the ones swapped in, appends the step's blocks to
block tables, then runs the decode loop once (``loop.step``): every decoding request drafts under its room and cap,
and one full-depth pass verifies every draft together with the step's prompt blocks - each prompt block its own
attention segment, so a block's rows depend on its tokens and those before it only (what prefix sharing needs).
A block planned as a depth slice (``Work.depths``) runs its core steps in a call of its own beside that pass.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Mapping

import torch

from ...model.cache import BlockTable, PagedCache, RingTable
from ...model.looped import LoopedLM
from .blocks import BlockPool
from ..drafting.context import DraftContext
from ..base.contract import Counts, PassTiming, Phase, RequestOutput, StepOutput, StepPlan
from ..drafting.draft import Drafter, Session
from .drafters import DrafterCache
from .loop import step as loop_step
from ..base.request import Request, greedy
from ..base.runtime import Runtime
from ..base.timing import Lap
from .verify import PrefillChunk, prefill_slice


class StepClock:
    """The seconds of one step's phases, charged to the step (once per pass) and to every request in a pass.  On
    CUDA its laps are events read once at the step's end (the step's verification already waited for the device
    when its verdicts came to the host)."""

    def __init__(self, out: StepOutput, device: torch.device):
        self.out, self.device = out, device
        self._laps: list[tuple[Phase, list[Request], Lap]] = []

    @contextmanager
    def __call__(self, phase: Phase, reqs: list[Request]):
        if not reqs:
            yield
            return
        lap = Lap(self.device).start()
        yield
        self._laps.append((phase, reqs, lap.stop()))

    def settle(self) -> None:
        if self._laps:
            self._laps[-1][2].wait()
            for phase, reqs, lap in self._laps:
                dt = lap.seconds()
                self.out.charge(phase, dt)
                for r in {id(r): r for r in reqs}.values():
                    r.counts.charge(phase, dt)
            self._laps.clear()


class Executor:
    def __init__(self, model: LoopedLM, R: int, pool: BlockPool, runtime: Runtime, drafters: DrafterCache,
                 prefix_caches: Mapping[int, object] | None = None):
        """``drafters`` resolves the plan's drafter keys; ``prefix_caches``: the prefix caches the plan's copies
        name, by key."""
        self.model, self.R, self.pool, self.runtime = model, R, pool, runtime
        self.drafter_cache = drafters
        self.prefix_caches = prefix_caches if prefix_caches is not None else {}
        self.requests: dict[int, Request] = {}
        self.sessions: dict[int, Session] = {}
        self.drafters: dict[int, Drafter] = {}
        self._saved: dict[int, list[torch.Tensor]] = {}       # swapped-out rows, on the host
        self._failed: set[int] = set()                         # requests whose setup failed (until released)

    def release(self, rid: int) -> None:
        """Drop a finished request's state (its blocks are the scheduler's)."""
        self.requests.pop(rid, None)
        self.sessions.pop(rid, None)
        self.drafters.pop(rid, None)
        self._saved.pop(rid, None)
        self._failed.discard(rid)

    def cancel(self, rid: int) -> None:
        """Stop request ``rid`` at its next drafting round (called between steps, or from the thread a step runs
        on; the scheduler ends it)."""
        req = self.requests.get(rid)
        if req is not None:
            req.cancelled = True

    def close(self) -> None:
        """Nothing to end in process (the remote executor ends its child)."""

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepOutput:
        out = StepOutput()
        start = time.perf_counter()
        for rid in plan.release:
            self.release(rid)
        clock = self._clock = StepClock(out, self.model.device)
        verified = None
        try:
            verified = self._execute(plan, out)
        finally:
            clock.settle()
            for rid, req in self.requests.items():           # what each request spent, and its trace
                if req.counts != _NOTHING or req.trace:
                    o = out.requests.get(rid) or out.requests.setdefault(rid, RequestOutput(rid))
                    o.counts, req.counts = req.counts, Counts()
                    if req.trace:
                        o.trace, req.trace = req.trace, []
        if verified:                                 # what the pass cost, to the drafters that drafted for it
            sessions, prefill_rows = verified
            host = max(time.perf_counter() - start - out.verify_time - out.draft_time - out.prefill_time, 0.0)
            timing = PassTiming(out.verify_time, out.rows_verified, len(sessions), prefill_rows, out.draft_time, host)
            for d in dict.fromkeys(s.drafter for s in sessions if s is not None):
                d.measured(timing)
        return out

    def _execute(self, plan: StepPlan, out: StepOutput) -> tuple[list, int] | None:
        """Run the plan; returns the verification pass's sessions (None for a request not asked to draft) and the
        prompt rows that rode in it, or None when no pass ran."""
        # (requests whose setup failed are skipped: a plan made beside that step - ``overlap`` - still names them,
        # and the scheduler ends them once the step is applied)
        for rid in plan.swap_out:                     # before anything else writes the blocks they held
            if rid in self._failed:
                continue
            req = self.requests[rid]
            self._saved[rid] = req.cache.save()
            req.depth_slice = None                    # a block in flight starts over when it is back
            req.cache.table.clear()
            for ring in req.cache.rings:
                ring.clear()
            req.cache.n = 0
        if self.runtime.static_shapes:                # static reads see every row of a block: no stale values
            fresh = [b for w in plan.work for b in w.new_blocks] + [b for _, bl in plan.swap_in for b in bl]
            fresh += [b for ring in plan.rings.values() for b in ring]
            shared = {b for s in plan.start for b in self._shared_blocks(plan, s)}
            self._zero([b for b in fresh if b not in shared])
        for s in plan.start:
            try:
                table = BlockTable(self.pool.B, self.pool.blocks_for(s.max_rows) * self.pool.B, self.model.device,
                                   static=self.runtime.static_shapes)
                drafter = self.drafter_cache.resolve(s.drafter)
                rings = self._rings(s.max_rows, plan.rings.get(s.id))
                req = Request(self.model, s.tokens, PagedCache(self.pool.cache, table, rings), R=self.R,
                              max_rows=s.max_rows, max_new_tokens=s.max_new_tokens, width=s.width,
                              init_scale=s.init_scale, state_seed=s.state_seed, runtime=self.runtime,
                              choose=s.sampling or greedy, exit=s.exit, deadline=s.deadline)
            except Exception as err:              # noqa: BLE001 - this request fails, the others go on
                out.failed.append((s.id, f"{type(err).__name__}: {err}"))
                self._failed.add(s.id)
                continue
            req.trace = [] if s.trace else None
            req.rid = s.id
            self.requests[s.id] = req
            self.drafters[s.id] = drafter
        for rid, blocks in plan.swap_in:
            if rid in self._failed:
                continue
            req = self.requests[rid]
            req.cache.table.append(blocks)
            self._rings(req.max_rows, plan.rings.get(rid), req.cache.rings)
            req.cache.restore(self._saved.pop(rid))
        work = [w for w in plan.work if w.id not in self._failed]
        for w in work:
            table = self.requests[w.id].cache.table
            if w.keep is not None:
                table.truncate(w.keep)
            table.append(w.new_blocks)
        for s in plan.start:                          # shared rows are in place; copied ones are copied now
            if s.id in self._failed:
                continue
            req = self.requests[s.id]
            rows = s.cached
            if s.copy is not None:
                key, a, b = s.copy
                self.prefix_caches[key].copy_blocks(req.cache, a, b)
                rows = b * self.pool.B
            if s.window_rows:                         # the shared prompt's window rows, into its rings
                req.cache.clear_rings()
                self._copy_window(req.cache, s.window_rows, into_rings=True)
            req.cache.n = req.prefilled = rows

        sessions, chunks, sliced, out_of = [], [], [], {}
        B = self.pool.B
        for w in work:
            req = self.requests[w.id]
            out.requests[w.id] = RequestOutput(w.id)
            if w.prefill is not None:
                a, b = w.prefill
                if a != req.prefilled:
                    raise RuntimeError(f"request {w.id}: prefill planned from row {a}, but {req.prefilled} are done")
                if w.depths is not None:              # a depth slice of one block, beside the pass
                    sliced.append(PrefillChunk(req, a, b - a, last=b == req.P, depths=w.depths))
                    continue
                for s0 in range(a, b, B):             # one segment per block (rows independent of the plan)
                    chunks.append(PrefillChunk(req, s0, min(B, b - s0), last=min(s0 + B, b) == req.P))
            elif w.id in self.sessions:
                if req.budget <= 0:                   # planned before its last step was applied: it has ended
                    continue
                req.room = min(req.budget, w.most)
                req.cap = w.cap
                req.closed = plan.closed
                s = self.sessions[w.id]
                sessions.append(s)
                out_of[s] = req
        if not sessions and not chunks and not sliced:
            return None
        clock = self._clock
        verified, first = loop_step(sessions, out_of, chunks, clock) if sessions or chunks else ([], [])
        passed = ([s for s, _, _ in verified], sum(c.size for c in chunks)) if verified else None
        for s, p, v in verified:
            o = out.requests[p.req.rid]
            o.tokens = list(v.tokens)
            o.verdict = (p.layout.proposals, v.accepted, len(v.tokens) > v.accepted)
            out.rows_verified += p.inputs
        ends = [c for c in chunks if c.last]
        for c in sliced:
            with clock(Phase.PREFILL, [c.req]):
                logits = prefill_slice(c)
            if c.depths[1] == self.R:                 # its last core step: the block is complete
                chunks.append(c)
                if c.last:
                    ends.append(c), first.append(logits)
        for c, logits in zip(ends, first):
            req = c.req
            token = int(req.choose(logits, req.P - 1)[-1])
            req.tokens[req.P] = token
            req.generated.append(token)
            out.requests[req.rid].tokens = [token]
        for c in chunks:
            c.req.cache.commit(c.size)
            c.req.prefilled += c.size
            out.requests[c.req.rid].prefilled += c.size
        for w in work:                                 # completed prompt blocks' window rows, kept for sharing
            if w.keep_window:
                self._copy_window(self.requests[w.id].cache, w.keep_window, into_rings=False)
        for c in ends:                                 # prefilled: its drafting session starts
            rid = c.req.rid
            with clock(Phase.DRAFT, [c.req]):
                self.sessions[rid] = self.drafters[rid].start(DraftContext(c.req))
        out.rows_drafted = sum(r.counts.draft_updates for r in self.requests.values())
        return passed

    def _rings(self, max_rows: int, blocks: list[int] | None, rings: list[RingTable] | None = None):
        """A request's windowed depths' rings over ``blocks`` (split evenly, depth 2 first): new ones, or
        ``rings`` given blocks again (swapped back in).  None without windowed depths."""
        if not self.pool.window:
            return None
        if not blocks:
            raise RuntimeError("a request of a pool with windowed depths was planned without its rings")
        per = len(blocks) // (self.R - 1)
        if rings is None:
            B = self.pool.B
            rings = [RingTable(B, self.pool.blocks_for(max_rows) * B, self.model.device,
                               static=self.runtime.static_shapes) for _ in range(self.R - 1)]
        for i, ring in enumerate(rings):
            ring.append(blocks[i * per: (i + 1) * per])
        return rings

    def _copy_window(self, cache: PagedCache, rows: list[tuple[int, int, int]], into_rings: bool) -> None:
        """Prompt blocks' rows at windowed depths between ``cache``'s rings and pool blocks: (depth r, prompt block
        q, block) - the block's rows into the ring (``into_rings``), or the ring's into the block."""
        B = self.pool.B
        ring = torch.cat([cache.ring_rows(r, q) for r, q, _ in rows])
        blocks = (torch.tensor([b for _, _, b in rows])[:, None] * B + torch.arange(B)).flatten().to(ring.device)
        cache.copy_core_rows(*((ring, blocks) if into_rings else (blocks, ring)))

    def _shared_blocks(self, plan: StepPlan, s) -> list[int]:
        w = next((w for w in plan.work if w.id == s.id), None)
        return w.new_blocks[: s.cached // self.pool.B] if w is not None else []

    def _zero(self, blocks: list[int]) -> None:
        if not blocks:
            return
        dev = self.pool.cache.core_k.device
        idx = (torch.tensor(blocks, device=dev)[:, None] * self.pool.B + torch.arange(self.pool.B, device=dev)).flatten()
        for t in self.pool.tensors():
            t.index_fill_(-2, idx, 0)


_NOTHING = Counts()
