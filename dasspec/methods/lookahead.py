"""Lookahead decoding (Fu et al. 2024), verified by the full-depth target.

One pass carries two branches on top of the verified prefix (root = the anchor at position p = n):

* the *lookahead branch*: a 2-D Jacobi window of ``ngram - 1`` levels x ``window`` columns.  Level 0 is the root
  followed by W-1 guessed tokens (positions p..p+W-1); level l, column i sits at position p+l+i and sees level 0
  up to column i and column i of levels 1..l - a causal chain of consecutive positions.  The argmax at the top
  level (l = N-2) refines the trajectory one position further;
* the *verification branch*: up to ``guess_set`` n-grams (N-1 tokens each) from the pool whose key is the root,
  each a chain hanging off the root at positions p+1..p+N-1 that sees only the root and its own prefix.

Both are one ``TreeLayout`` (every window token's visible set is its chain of ancestors, positions are depths),
so ``verify_tree`` runs the pass; only the n-gram chains are candidates and only the winner's K/V are compacted
into place.  After the pass, every column i yields an N-gram (level 0..N-2 of column i + its top-level argmax)
that enters the pool under key level0[i] (LRU, at most G per key), and the window slides by one level
(level l <- level l+1, the top level <- the new argmax), as in the reference's ALWAYS_FWD_ONE.

Differences from the reference (``hao-ai-lab/LookaheadDecoding``), on purpose:

* the dropped-bonus bug is fixed (issue #56): when all N-1 tokens of the best n-gram match, the target's token
  after them is emitted too, so up to N tokens are committed per pass (the reference stops at N-1);
* the window starts full - every level drawn from the prompt tokens with a fixed seed - rather than being grown
  one level per forward; n-grams enter the pool only after N-2 passes, when levels 1..N-2 hold model outputs,
  which is when the reference's pool receives its first entries.  Warm-up passes are therefore full-width;
* where the window would reach past the tokens that may still be committed (the budget rule, ``drafting/draft.py``) a step
  is a plain AR step.

Knobs: ``window`` W (7), ``ngram`` N (5), ``guess_set`` G (7) - the README / Spec-Bench setting - and
``pool_from_prompt`` (False; True seeds the pool with the prompt's N-grams).  A pass has at most
W(N-1) + G(N-1) positions.  The pool is created per request; its host-side updates (W dict inserts per pass)
and the window bookkeeping are inside the timed draft phase.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..engine.drafting import Draft, DraftContext, Drafter, Session, TreeLayout, Verdict
from . import Method, register
from .knobs import Knobs, Most, boolean, knob, positive_int


def lookahead_parents(W: int, N: int, g: int) -> tuple[list[int], list[int]]:
    """Parents of the pass's T = W(N-1) + g(N-1) inputs in order [root, level0[1:], level1, ..., level N-2,
    guess_1, ..., guess_g], and the last node of each guess (the candidate leaves)."""
    parents = [-1] + list(range(W - 1))                 # level 0: the root's chain
    for level in range(1, N - 1):
        lo = level * W                                   # index of (level, column 0)
        parents += [lo - W + i for i in range(W)]        # column i's parent: same column, one level down
    leaves = []
    for _ in range(g):
        base = len(parents)
        parents += [0] + [base + j for j in range(N - 2)]
        leaves.append(len(parents) - 1)
    return parents, leaves


class NgramPool:
    """key token -> up to G (N-1)-token continuations, least recently inserted first (LRU on insert)."""

    def __init__(self, G: int):
        self.G = G
        self.table: dict[int, dict[tuple, None]] = {}

    def insert(self, key: int, gram: tuple) -> None:
        d = self.table.get(key)
        if d is None:
            d = self.table[key] = {}
        elif gram in d:
            del d[gram]                      # re-inserting refreshes it
        d[gram] = None
        if len(d) > self.G:
            del d[next(iter(d))]

    def get(self, key: int) -> list[tuple]:
        d = self.table.get(key)
        return list(d) if d else []


class LookaheadState:
    def __init__(self, req: DraftContext, W: int, N: int, G: int, pool_from_prompt: bool, seed: int = 0):
        self.W, self.N, self.G = W, N, G
        prompt = np.asarray(req.prompt, dtype=np.int64)
        rng = np.random.default_rng(seed)
        self.window = prompt[rng.integers(0, len(prompt), size=(N - 1, W))]   # [level, column]; [0, 0] unused
        self.pool = NgramPool(G)
        self.passes = 0
        if pool_from_prompt:
            for i in range(len(prompt) - N + 1):
                self.pool.insert(int(prompt[i]), tuple(int(t) for t in prompt[i + 1: i + N]))
        device = req.device
        self.layouts = [TreeLayout(*lookahead_parents(W, N, g), device=device) for g in range(G + 1)]

    def inputs(self, root: int) -> tuple[list[int], TreeLayout]:
        """Host token list for slots [n+1, n+T) and the pass layout."""
        cands = self.pool.get(root)
        flat = self.window.reshape(-1)[1:].tolist()
        for c in cands:
            flat.extend(c)
        return flat, self.layouts[len(cands)]

    def update(self, root: int, top: list[int]) -> None:
        """Pool the column N-grams (after warm-up) and slide the window by one level."""
        N = self.N
        win = self.window
        if self.passes >= N - 2:
            keys = win[0].tolist()
            keys[0] = root
            grams = np.concatenate((win[1:], np.asarray(top)[None, :]), axis=0).T.tolist()   # [W, N-1]
            for key, gram in zip(keys, grams):
                self.pool.insert(key, tuple(gram))
        win[:-1] = win[1:]
        win[-1] = top
        self.passes += 1


def most_guesses(kn: "LookaheadKnobs", s) -> int:
    """The largest G with (G + 1) x ((W + G)(N - 1))^2 <= context^2 (0 when none)."""
    fits = lambda g: (g + 1) * ((kn.window + g) * (kn.ngram - 1)) ** 2 <= s.context ** 2    # noqa: E731
    lo, hi = 0, s.context
    while lo < hi:                          # the left side grows with G: bisect
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


_PASS = "a pass of (window + guess_set) x (ngram - 1) positions is verified at once"


@dataclass(frozen=True)
class LookaheadKnobs(Knobs):
    method = "lookahead"
    window: int = knob(7, "Lookahead: Jacobi window W", most=Most(
        "context // (ngram - 1) - guess_set", _PASS, lambda kn, s: s.context // (kn.ngram - 1) - kn.guess_set))
    ngram: int = knob(5, "Lookahead: n-gram size N", most=Most(
        "context // (window + guess_set) + 1", _PASS, lambda kn, s: s.context // (kn.window + kn.guess_set) + 1))
    guess_set: int = knob(7, "Lookahead: most n-gram candidates verified per step G", most=Most(
        "the largest G with (G + 1) x ((window + G)(ngram - 1))^2 <= context^2",
        "a request lays out the pass for every count of candidates 0..G, each with a (pass width)^2 visibility "
        "mask", most_guesses))
    pool_from_prompt: bool = knob(False, "Lookahead: seed the n-gram pool with the prompt's n-grams")

    def validate(self, R: int) -> "LookaheadKnobs":
        positive_int(self, "window", "ngram", "guess_set")
        if self.ngram < 2:
            raise ValueError(f"ngram must be >= 2 (an n-gram is a key plus at least one token), got {self.ngram}")
        boolean(self, "pool_from_prompt")
        return self


class LookaheadSession(Session):
    def __init__(self, drafter: "LookaheadDrafter", req: DraftContext):
        super().__init__(drafter, req)
        k = drafter.knobs
        self.state = LookaheadState(req, k.window, k.ngram, k.guess_set, k.pool_from_prompt)
        self.root: int | None = None

    def propose(self) -> Draft:
        req = self.ctx
        self.root = req.generated[-1]
        flat, layout = self.state.inputs(self.root)
        # No room for the window inside the context, or for a guess inside the budget: a plain AR step.
        if layout.max_depth > req.depth_limit or self.drafter.knobs.ngram - 1 > req.room - 1:
            self.root = None
            return Draft()
        return Draft(flat, layout=layout)

    def observe(self, verdict: Verdict) -> None:
        if self.root is not None:
            lo, W = self.drafter.top_lo, self.drafter.knobs.window
            self.state.update(self.root, verdict.pred[lo: lo + W].tolist())


class LookaheadDrafter(Drafter):
    name = "lookahead"
    width_knobs = ("window", "ngram", "guess_set")
    session = LookaheadSession

    def __init__(self, knobs: LookaheadKnobs):
        self.knobs = knobs
        self.width = (knobs.window + knobs.guess_set) * (knobs.ngram - 1)
        self.top_lo = knobs.window * (knobs.ngram - 2)       # index of (level N-2, column 0) in the pass


register(Method("lookahead", LookaheadKnobs, LookaheadDrafter))
