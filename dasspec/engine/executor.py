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

import torch

from ..model.cache import BlockTable, PagedCache
from ..model.looped import LoopedLM
from .blocks import BlockPool
from .context import DraftContext
from .draft import Session
from .loop import step as loop_step
from .request import Request
from .runtime import Runtime
from .scheduler import RequestOutput, StepOutput, StepPlan
from .verify import PrefillChunk, prefill_slice


class Executor:
    def __init__(self, model: LoopedLM, R: int, pool: BlockPool, runtime: Runtime):
        self.model, self.R, self.pool, self.runtime = model, R, pool, runtime
        self.requests: dict[int, Request] = {}
        self.sessions: dict[int, Session] = {}
        self.drafters: dict[int, object] = {}
        self._saved: dict[int, list[torch.Tensor]] = {}       # swapped-out rows, on the host

    def release(self, rid: int) -> None:
        """Drop a finished request's state (its blocks are the scheduler's)."""
        req = self.requests.pop(rid, None)
        if req is not None:
            req.finish()
        self.sessions.pop(rid, None)
        self.drafters.pop(rid, None)
        self._saved.pop(rid, None)

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepOutput:
        out = StepOutput()
        for rid in plan.swap_out:                     # before anything else writes the blocks they held
            req = self.requests[rid]
            self._saved[rid] = req.cache.save()
            req.depth_slice = None                    # a block in flight starts over when it is back
            req.cache.table.clear()
            req.cache.n = 0
        if self.runtime.static_shapes:                # static reads see every row of a block: no stale values
            fresh = [b for w in plan.work for b in w.new_blocks] + [b for _, bl in plan.swap_in for b in bl]
            shared = {b for s in plan.start for b in self._shared_blocks(plan, s)}
            self._zero([b for b in fresh if b not in shared])
        failed = set()
        for s in plan.start:
            try:
                table = BlockTable(self.pool.B, self.pool.blocks_for(s.max_rows) * self.pool.B, self.model.device,
                                   static=self.runtime.static_shapes)
                req = Request(self.model, s.tokens, PagedCache(self.pool.cache, table), R=self.R,
                              max_rows=s.max_rows, max_new_tokens=s.max_new_tokens, width=s.drafter.width, runtime=self.runtime, stats=s.stats,
                              stop_check=s.stop_check, **s.options)
            except Exception as err:              # noqa: BLE001 - this request fails, the others go on
                out.failed.append((s.id, err))
                failed.add(s.id)
                continue
            req.trace = s.trace
            req.rid = s.id
            self.requests[s.id] = req
            self.drafters[s.id] = s.drafter
        for rid, blocks in plan.swap_in:
            req = self.requests[rid]
            req.cache.table.append(blocks)
            req.cache.restore(self._saved.pop(rid))
        work = [w for w in plan.work if w.id not in failed]
        for w in work:
            table = self.requests[w.id].cache.table
            if w.keep is not None:
                table.truncate(w.keep)
            table.append(w.new_blocks)
        for s in plan.start:                          # shared rows are in place; copied ones are copied now
            if s.id in failed:
                continue
            req = self.requests[s.id]
            rows = s.cached
            if s.copy is not None:
                pc, a, b = s.copy
                pc.copy_blocks(req.cache, a, b)
                rows = b * self.pool.B
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
                req.room = w.room if not w.cap else min(w.room, w.cap + 1)
                req.cap = w.cap
                req.closed = plan.closed
                s = self.sessions[w.id]
                sessions.append(s)
                out_of[s] = req
        if not sessions and not chunks and not sliced:
            return out
        verified, first = loop_step(sessions, out_of, chunks, self._timer) if sessions or chunks else ([], [])
        for s, p, v in verified:
            o = out.requests[p.req.rid]
            o.tokens = list(v.tokens)
            o.verdict = (p.layout.proposals, v.accepted, len(v.tokens) > v.accepted)
        ends = [c for c in chunks if c.last]
        for c in sliced:
            with self._timer("prefill", [c.req]):
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
        for c in ends:                                 # prefilled: its drafting session starts
            rid = c.req.rid
            with self._timer("draft", [c.req]):
                self.sessions[rid] = self.drafters[rid].start(DraftContext(c.req))
        return out

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
        for r in {id(r): r for r in reqs}.values():
            setattr(r.stats, attr, getattr(r.stats, attr) + dt)
