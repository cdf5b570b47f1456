"""What each arm earns: tokens committed and verifier rows per step, per request and arm (moving averages of its
verdicts), over the drafter's requests (``Priors``: what a request that has not measured an arm starts from), and
for the lookup arms (SAM, PLD) scored *off-policy* every step they are not used: their drafts cost no model pass
and the committed tokens do not depend on the draft, so the tokens a chain would have committed (its longest prefix
matching what was committed, plus one) are known exactly once the next tokens are."""

from __future__ import annotations

from typing import Callable

from .costs import LOOKUP, ema
from .tuning import TUNING, Tuning


class ArmStats:
    __slots__ = ("tok", "slow", "rows", "n", "last")   # per request and arm

    def __init__(self):
        self.tok: float | None = None      # tokens committed per step (moving average)
        self.slow: float | None = None     # the same, averaged over more steps
        self.rows: float | None = None     # verifier rows per step
        self.n = 0
        self.last = 0                      # the request's step of the last measurement (its start: none yet)

    def add(self, tok: float, rows: float, step: int, alpha: float, slow_alpha: float | None = None) -> None:
        self.tok = ema(self.tok, tok, alpha)
        self.slow = ema(self.slow, tok, alpha if slow_alpha is None else slow_alpha)
        self.rows = ema(self.rows, rows, alpha)
        self.n += 1
        self.last = step

    @property
    def sustained(self) -> float | None:
        """Tokens per step to expect for the rest of a budget: the lower of the two averages, so one lucky step does
        not commit a whole batch, while a fall is followed at the faster one's pace."""
        return None if self.tok is None else min(self.tok, self.slow)


class Priors:
    """Per arm, the drafter's running average over its requests of (tokens, rows) per step, and how many requests
    have measured it (``requests``: a batch plan trusts an average of fewer only where it wins by far)."""

    def __init__(self, tuning: Tuning = TUNING):
        self.alpha = tuning.prior_alpha
        self.table: dict[str, tuple[float, float]] = {}
        self.requests: dict[str, int] = {}

    def add(self, arm: str, tok: float, rows: float) -> None:
        old = self.table.get(arm)
        self.table[arm] = (tok, rows) if old is None else (ema(old[0], tok, self.alpha), ema(old[1], rows, self.alpha))

    def get(self, arm: str) -> tuple[float, float] | None:
        return self.table.get(arm)


class Earnings:
    """One request's measurements per arm, and its pending off-policy lookup drafts."""

    def __init__(self, arms, priors: Priors, tuning: Tuning = TUNING):
        self.t, self.priors = tuning, priors
        self.arms = {arm: ArmStats() for arm in arms}
        self.pending: dict[str, tuple[int, list[int]]] = {}   # lookup arm -> (generated length, its draft then)

    def tok_rows(self, arm: str, sustained: bool = False) -> tuple[float | None, float | None]:
        """Tokens and verifier rows per step of ``arm`` for this request (the drafter's average over its requests
        while this one has not measured it; None when nobody has); ``sustained``: over the rest of a budget."""
        if arm == "ar":
            return 1.0, 1.0
        st = self.arms[arm]
        if st.n:
            return (st.sustained if sustained else st.tok), st.rows
        prior = self.priors.get(arm)
        return (prior[0], prior[1]) if prior is not None else (None, None)

    def verdict(self, arm: str, tok: int, rows: int, step: int) -> None:
        """The verdict of a step drafted with ``arm`` (not AR)."""
        t = self.t
        self._first(arm)
        st = self.arms[arm]
        if arm in LOOKUP:
            st.add(tok, rows, step, t.step_alpha, t.slow_alpha)
        else:
            prior = self.priors.get(arm)
            if st.n == 0 and prior is not None:
                # a model drafter's first block here is one sample, and often its worst (DAS-Wave's copy runs follow
                # a block of its own): it moves the drafter's average over the other requests, not replaces it
                st.tok = st.slow = prior[0]
                st.rows = prior[1]
            st.add(tok, rows, step, t.probe_alpha)
        self.priors.add(arm, tok, rows)
        self.pending.pop(arm, None)

    def shadow(self, subs: dict, used: str, generated: int, room: int,
               charge: Callable[[str, float], None], clock: Callable[[], float]) -> None:
        """Ask each lookup arm not ``used`` this step for its draft (host work only, timed by ``clock`` and
        ``charge``d to its drafting cost) and keep it, to score once the next tokens are committed."""
        if room <= 1:                      # an empty draft would score as a miss
            return
        for arm in LOOKUP:
            if arm not in subs or arm == used or arm in self.pending:
                continue
            t0 = clock()
            draft = subs[arm].propose()
            charge(arm, clock() - t0)
            if draft.layout is not None:              # a tree (SAM's static corpus): not scored off-policy
                continue
            toks = draft.tokens
            toks = toks.tolist() if hasattr(toks, "tolist") else list(toks)
            self.pending[arm] = (generated, [int(x) for x in toks][: max(room - 1, 0)])

    def resolve(self, generated: list[int], step: int) -> None:
        """Score the pending lookup drafts the committed tokens now decide (a lower bound once the first
        ``early_resolve`` matched, so a run of matches counts at once)."""
        t = self.t
        for arm, (at, toks) in list(self.pending.items()):
            seen = generated[at: at + len(toks)]
            m = 0
            while m < len(seen) and seen[m] == toks[m]:
                m += 1
            if m < len(seen) or m == len(toks) or m >= t.early_resolve:
                del self.pending[arm]
                rows = len(toks) + 1 if toks else 1
                self._first(arm)
                self.arms[arm].add(m + 1, rows, step, t.step_alpha, t.slow_alpha)
                self.priors.add(arm, m + 1, rows)

    def _first(self, arm: str) -> None:
        """Count this request among the arm's measurers at its first measurement."""
        if not self.arms[arm].n:
            self.priors.requests[arm] = self.priors.requests.get(arm, 0) + 1
