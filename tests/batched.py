"""Test helper: many requests decoded together by one ``dasspec.Engine`` - how the lossless suites check every
method on many prompts at once (each result must equal that prompt's own batch-1 AR decode)."""

from __future__ import annotations

import dasspec
from dasspec.engine.api.engine import Engine


def decode_together(model, requests: list[dict], method: str = "ar", knobs: dict | None = None, drafter=None,
                    max_batch: int | None = None, **engine_options) -> list[dasspec.GenerationResult]:
    """``requests``: ``Engine.add`` keyword arguments (``prompt`` included), all added at once; one result each, in
    order.  ``drafter``: a kept drafter shared by every request (else the engine builds ``method``'s)."""
    engine = Engine(model, method if drafter is None else "ar", knobs if drafter is None else None,
                    max_batch=max_batch or len(requests), **engine_options)
    ids = [engine.add(**({"drafter": drafter} if drafter is not None else {}), **r) for r in requests]
    while engine.has_work:
        engine.step()
    return [engine.result(i) for i in ids]
