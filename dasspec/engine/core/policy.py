"""How much the engine speculates per step.  Every method emits exactly AR's tokens, so this is a speed choice
only: as the batch grows, one verification pass over everyone's drafts costs more (on a GPU once the batch's rows
stop being free; on a CPU almost at once), and speculation stops paying well before it stops being correct -
vLLM switches it off above a batch size.

``cap(decoding)`` -> the most proposals a draft may carry this step: None (the method's own drafts), a number
(chains are cut to it; tree drafts - DAS-Wave's seed branches, Token Recycling, Lookahead - are verified whole,
since a session reads its verdict against the tree it proposed), or 0 (no drafts: every request takes one
full-depth AR step).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SpeculationPolicy:
    """``off_above``: with more requests decoding than this, no drafts (None: always speculate).
    ``max_tokens``: the most proposals per step over the whole batch, shared evenly among chains (None: no
    limit; tree drafts are not cut: use ``off_above`` for methods that draft trees)."""

    off_above: int | None = None
    max_tokens: int | None = None

    def __post_init__(self) -> None:
        for name in ("off_above", "max_tokens"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise ValueError(f"{name} must be a whole number >= 0 or None, got {v!r}")

    def cap(self, decoding: int) -> int | None:
        if self.off_above is not None and decoding > self.off_above:
            return 0
        if self.max_tokens is not None and decoding:
            return self.max_tokens // decoding
        return None
