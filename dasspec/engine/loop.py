"""The decode loop - the only one: prefill, then propose -> verify -> observe until the stop rule says done.

    req.prefill()                                  # the prompt at every depth, the first token
    drafter.start(req)
    while not req.done:
        draft = drafter.propose(req)               # AR proposes nothing
        verdict = verify(req, *place(req, draft))  # full depth, chain or tree; commits; stop rule
        drafter.observe(req, verdict)

Drafting (propose, observe, start) is timed as the draft phase, verification as the verify phase.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from .draft import Draft, Drafter, TreeLayout, Verdict
from .request import Request
from .verify import verify


def place(req: Request, draft: Draft) -> tuple[TreeLayout, int]:
    """Put the draft's tokens after the anchor (unless the drafter wrote them there) and return the verifier's
    layout and input count.  A chain is cut to what the budget can keep (no pass computes a position whose token
    would be dropped); trees are cut by their drafters.  The cache capacity is checked before anything is run."""
    tokens = draft.tokens
    w = len(tokens)
    if draft.layout is None:
        w = min(w, req.budget - 1 if draft.bonus else req.budget)
        layout = TreeLayout.chain(w + 1, req.tokens.device)
        inputs = w + 1 if draft.bonus or w == 0 else w
    else:
        layout = draft.layout
        inputs = layout.size
        if w != layout.size - 1:
            raise ValueError(f"a draft tree of {layout.size} nodes needs {layout.size - 1} tokens after the anchor, "
                             f"got {w}")
    req.check_fits(inputs, layout.size)
    if w:
        slots = req.tokens[req.n + 1: req.n + 1 + w]
        if not (isinstance(tokens, torch.Tensor) and tokens.data_ptr() == slots.data_ptr()):
            if isinstance(tokens, np.ndarray):
                tokens = torch.from_numpy(tokens)
            slots.copy_(torch.as_tensor(tokens[:w], dtype=torch.long))
    return layout, inputs


def decode(req: Request, drafter: Drafter, trace: list | None = None) -> None:
    """Run ``req`` to its stop with ``drafter``.  ``trace``: a list that receives (draft, verdict) per block, the
    draft with its tokens as placed (a host copy: the scratch slots are reused) and its layout."""
    req.prefill()
    with req.timer("draft"):
        drafter.start(req)
    while not req.done:
        with req.timer("draft"):
            draft = drafter.propose(req)
            layout, inputs = place(req, draft)
        if trace is not None:                       # the slots are rewritten by the verifier and the next block
            placed = replace(draft, tokens=req.tokens[req.n + 1: req.n + layout.size].tolist(), layout=layout)
        verdict: Verdict = verify(req, layout, inputs)
        with req.timer("draft"):
            drafter.observe(req, verdict)
        if trace is not None:
            trace.append((placed, verdict))
