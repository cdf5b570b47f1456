"""The decode loop - the only one - as one step over every running request:

    drafts = drafter.propose_batch(sessions)        # per drafter, its running sessions at once (AR: nothing)
    placed = [place(req, draft) for ...]            # after each anchor; cut to the budget rule (draft.py)
    verdicts = verify_step(placed, prefill_chunks)  # one full-depth pass: every draft and prompt block
    session.observe(verdict)                        # each session learns its verdict

The executor (``executor.py``) runs it once per engine step; the step's draft cap is part of each request's
``room`` before anyone drafts (a cap of 0: nobody drafts, every request takes one full-depth AR step).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

import numpy as np
import torch

from ..base.contract import Phase
from ..drafting.draft import Draft, Drafter, Session, TreeLayout, Verdict
from ..base.request import Request
from .verify import Placed, PrefillChunk, verify_step


def place(req: Request, draft: Draft) -> Placed:
    """Put the draft's tokens after the anchor (unless the drafter wrote them there) and return it placed for the
    verifier.  A chain is cut to the budget rule (every verifier input at depth <= room - 1: no pass computes a
    position whose token would be dropped; ``room`` includes the step's draft cap) and to the rows its request's
    blocks back this step (a drafter's ``reach`` past its ``width`` is backed only when memory allows); a tree that
    breaks the rule is refused (its drafter must cut it, and fit its ``width``).  The cache capacity is checked before anything runs."""
    tokens = draft.tokens
    w = len(tokens)
    if draft.layout is None:
        w = min(w, req.room - 1 if draft.bonus else req.room)
        backed = req.cache.capacity - req.n               # rows the step's blocks back past the anchor (and it)
        w = max(0, min(w, backed - 1 if draft.bonus else backed))
        layout = TreeLayout.chain(w + 1, req.device)
        inputs = w + 1 if draft.bonus or w == 0 else w
    else:
        layout = draft.layout
        inputs = layout.size
        if w != layout.size - 1:
            raise ValueError(f"a draft tree of {layout.size} nodes needs {layout.size - 1} tokens after the anchor, "
                             f"got {w}")
        if layout.candidate_depth > req.room - 1:
            raise ValueError(f"a draft tree's candidates reach depth {layout.candidate_depth} below the anchor, but "
                             f"only {req.room} more tokens may be committed: candidates must lie at depth <= room - 1 "
                             "(the budget rule in dasspec/engine/drafting/draft.py)")
        if layout.max_depth > req.depth_limit:
            raise ValueError(f"a draft tree reaches position {req.n + layout.max_depth}, beyond the model context "
                             f"({req.model.config.block_size})")
    req.check_fits(inputs, layout.size)
    if w and not draft.in_place:
        slots = req.tokens[req.n + 1: req.n + 1 + w]
        if isinstance(tokens, np.ndarray):
            tokens = torch.from_numpy(tokens)
        slots.copy_(torch.as_tensor(tokens[:w], dtype=torch.long))
    return Placed(req, layout, inputs)


def traced(p: Placed, draft: Draft) -> Draft:
    """The draft as placed, for a trace: host tokens (the slots are rewritten by the verifier) and its layout."""
    n = p.req.n
    return replace(draft, tokens=p.req.tokens[n + 1: n + p.layout.size].tolist(), layout=p.layout)


def propose(groups: dict[Drafter, list[Session]]) -> list[tuple[Session, Draft | None]]:
    """Every session's draft for this step, each drafter asked once for the sessions it may draft for (a request
    whose cap is 0 takes a plain AR step: None, and its session is not asked)."""
    out: list[tuple[Session, Draft]] = []
    for drafter, sessions in groups.items():
        drafting = [s for s in sessions if s.ctx.cap != 0]
        out.extend(zip(drafting, drafter.propose_batch(drafting) if drafting else []))
        out.extend((s, None) for s in sessions if s.ctx.cap == 0)
    return out


def step(sessions: Sequence[Session], requests: dict, prefills: Sequence[PrefillChunk] = (),
         timer=None) -> tuple[list[tuple[Session, Placed, Verdict]], list]:
    """One step of the decode loop over ``sessions`` (each of a running, prefilled request; ``requests`` maps a
    session to its ``Request``) and the prompt blocks in ``prefills``.  A request that must stop
    (``Request.stopping``) by the end of drafting is left out of the pass.  ``timer(phase, requests)``: a context
    manager charging a phase to requests.  Returns each verified session with its placed draft and verdict, and the
    first-token logits of every prompt that ended."""
    groups: dict[Drafter, list[Session]] = {}
    for s in sessions:
        groups.setdefault(s.drafter, []).append(s)
    reqs = [requests[s] for s in sessions]
    with timer(Phase.DRAFT, reqs):
        proposed = propose(groups)
        placed, live, drafts = [], [], []
        for s, d in proposed:
            req = requests[s]
            if req.stopping() is not None:       # cancelled or out of time while drafting: not verified
                continue
            p = place(req, d or Draft())
            placed.append(p)
            live.append(s if d is not None else None)      # a session observes the verdicts of its own drafts
            drafts.append(traced(p, d or Draft()) if req.trace is not None else None)
    phase = Phase.VERIFY if placed else Phase.PREFILL
    with timer(phase, [p.req for p in placed] + [c.req for c in prefills]):
        verdicts, first = verify_step(placed, list(prefills))
    with timer(Phase.DRAFT, [p.req for p in placed]):
        for s, p, d, v in zip(live, placed, drafts, verdicts):
            if d is not None:
                p.req.trace.append((d, v))
            if s is not None:
                s.observe(v)
    return list(zip(live, placed, verdicts)), first

