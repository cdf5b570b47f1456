"""What auto measured on a model in this process, kept for the next ``generate`` / ``generate_batch`` call on it:
the cost model's prices and each arm's average earnings over the requests (``Priors``).  The exploration budget is
not kept: each call's probes stay within ``explore`` of that call's own decoding.

Why: ``generate`` and ``generate_batch`` build a drafter per call.  A fresh one knows nothing, so it waits for a
plain pass to price and probes every model-drafting arm at its first step (``first-measure``) - on a model where the
drafts earn nothing, a probe that costs a few percent of a short request, paid by every call.  With the prices and
averages kept, a call starts where the last one left off; a request still measures an arm itself before it relies
on it, except where the average says it wins by far (``trusted-prior``).  Carrying the budget too, as a drafter kept
across requests does, measured worse (docs/performance-journal.md, "auto's outcomes kept between generate calls"):
later calls then spent their share on probes that a short call does not repay.

Only the calls that build their drafter read and write here: a drafter built by its user (``build_drafter``), an
``Engine``, the server or lm-eval carries its own state (the ``recall`` knob has no effect there).  The shelf is
weakly keyed by the model object - not in its ``__dict__``, so a pickled, saved or copied model starts afresh - and
holds the last ``kept_keys`` keys.  A key is what moves the prices or the averages: the calibration's keys (model
shape, dtype, device, threads, kernels), the depth, auto's knobs and its sub-drafters' (DAS-Wave's window), the
tuning, and the call's runtime, exit rule, greedy or sampling options, pool layout (``window_kv``) and speculation
policy."""

from __future__ import annotations

import copy
import hashlib
import threading
import weakref
from collections import OrderedDict
from dataclasses import astuple

from .calibrate import cache_keys
from .costs import CostModel
from .earnings import Priors

Kept = tuple[CostModel, Priors]

_shelves: "weakref.WeakKeyDictionary[object, OrderedDict[str, Kept]]" = weakref.WeakKeyDictionary()
_lock = threading.Lock()             # calls on other threads keep and recall at once


def memory_key(model, R: int, knobs, tuning, call: tuple) -> str:
    """``call``: what the calling ``generate`` decides besides (runtime, exit rule, greedy or its sampling, the
    pool's layout, the policy) and the sub-drafters' knobs."""
    mkey, machine = cache_keys(model)
    rest = repr((R, astuple(knobs), astuple(tuning), call))
    return f"{mkey}:{machine}:" + hashlib.sha256(rest.encode()).hexdigest()[:16]


def recall(model, key: str) -> Kept | None:
    """A copy of what was kept under ``key``: the drafter that takes it learns on its own copy."""
    with _lock:
        try:
            shelf = _shelves.get(model)
        except TypeError:                # a model class that is not hashable: nothing kept for it
            return None
        got = None if shelf is None else shelf.get(key)
        if got is None:
            return None
        shelf.move_to_end(key)
        return copy.deepcopy(got)


def keep(model, key: str, state: Kept, most: int) -> None:
    """Keep a copy of ``state`` under ``key``, and the ``most`` keys used last for ``model``."""
    state = copy.deepcopy(state)
    with _lock:
        try:
            shelf = _shelves.setdefault(model, OrderedDict())
        except TypeError:
            return
        shelf[key] = state
        shelf.move_to_end(key)
        while len(shelf) > most:
            shelf.popitem(last=False)
