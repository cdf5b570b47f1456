"""What auto measured on a model, kept on the model object for the next auto drafter this process builds on it: the
cost model's prices and each arm's average earnings over the requests (``Priors``).  The exploration budget is not
kept: each call's probes stay within ``explore`` of that call's own decoding.

Why: ``generate`` and ``generate_batch`` build a drafter per call.  A fresh one knows nothing, so it waits for a
plain pass to price and probes every model-drafting arm at its first step (``first-measure``) - on a model where the
drafts earn nothing, a probe that costs a few percent of a short request, paid by every call.  With the prices and
averages kept, a call starts where the last one left off; a request still measures an arm itself before it relies
on it, except where the average says it wins by far (``trusted-prior``).  Carrying the budget too, as a drafter kept
across requests does, measured worse (``benchmarks/journal/auto/recall_ab.py``; docs/performance-journal.md): later
calls then spent their share on probes that a short call does not repay.  In memory only: what a drafter earns
follows the text, so nothing is written to disk.

Keyed by the machine's key of the calibration (model shape, dtype, device, threads, kernels), the depth, greedy or
sampled, and the knobs, so a drafter never starts from prices measured at another thread count or depth."""

from __future__ import annotations

import copy
from dataclasses import astuple

from .calibrate import _keys
from .costs import CostModel
from .earnings import Priors

Kept = tuple[CostModel, Priors]

ATTR = "_auto_outcomes"


def memory_key(model, R: int, sampled: bool, knobs) -> str:
    mkey, machine = _keys(model)
    return f"{mkey}:{machine}:R={R}:{'sampled' if sampled else 'greedy'}:{astuple(knobs)!r}"


def shelf(model) -> dict:
    """The model's kept outcomes (created on first use; on the model object, so they go with it)."""
    return model.__dict__.setdefault(ATTR, {})


def recall(kept: dict, key: str) -> Kept | None:
    """A copy of what was kept under ``key``: the drafter that takes it learns on its own copy."""
    got = kept.get(key)
    return None if got is None else copy.deepcopy(got)


def keep(kept: dict, key: str, state: Kept) -> None:
    kept[key] = copy.deepcopy(state)
