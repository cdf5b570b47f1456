"""Prompt Lookup Decoding (Saxena 2023), verified by the full-depth target.

Each step looks for the longest n-gram (n = ``max_ngram`` down to 1) that ends the committed text (prompt +
generated, anchor included) and also occurs earlier in it; the first (earliest) earlier occurrence wins and the
up to ``num_pred`` tokens that followed it are the draft.  Defaults ``max_ngram=3``, ``num_pred=10`` are the
original PLD's.  As in Hugging Face's ``PromptLookupCandidateGenerator`` (and unlike the original notebook) a
continuation that runs into the end of the text is truncated rather than skipped, and a step with no match is a
plain AR step - never a dummy draft token.

The draft is verified as a chain with the bonus token: the verifier input is [anchor, d_1..d_k] (k + 1
positions) and up to k + 1 tokens are committed per pass.  Matching runs on a host copy of the text kept
incrementally, through an index of its n-grams that grows with it (``SuffixIndex``); past the index's bounds, by a
scan vectorised over all end positions and n-gram sizes (numpy), inside the timed draft phase.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..engine.drafting import Draft, DraftContext, Drafter, Session
from . import Method, register
from .knobs import Knobs, Most, knob, positive_int

# The ceiling of a suffix n-gram's length (prompt lookup here, DAS-Wave's seeds).
MAX_NGRAM = Most("the context", "no longer n-gram fits in the text", lambda kn, s: s.context)

def longest_suffix_matches(seq: np.ndarray, max_ngram: int) -> np.ndarray:
    """End positions e < L-1 of the earlier occurrences of the text's longest repeated suffix n-gram, n <= max_ngram
    (ascending; empty when even the last token never occurred before)."""
    L = seq.shape[0]
    ends = max(L - 1, 0)
    run = np.zeros(ends, dtype=np.int64)          # run[e]: tokens ending at e equal to the text's last ones
    alive = np.ones(ends, dtype=bool)
    for k in range(min(max_ngram, ends)):
        # compare seq[e-k] with seq[L-1-k] for e in [k, L-2]
        eq = np.zeros(ends, dtype=bool)
        eq[k:] = seq[: ends - k] == seq[L - 1 - k]
        alive &= eq
        run += alive
    n = run.max(initial=0)
    return np.flatnonzero(run == n) if n else run[:0]


def after_first(seq: np.ndarray, first: int, last: int, num_pred: int) -> np.ndarray:
    """The tokens after the earliest match (ending at ``first``): the PLD draft."""
    return seq[first + 1: first + 1 + num_pred]


def copy_latest(seq: np.ndarray, first: int, last: int, num_pred: int) -> np.ndarray:
    """``num_pred`` tokens copied from after the latest match (ending at ``last``), continuing into the copy itself
    (LZ77-style): with the match p tokens back the draft repeats the text's last p tokens, so a run of one token
    (p = 1) or a cycle of period p extends to any length."""
    L = seq.shape[0]
    p = L - 1 - last                              # period: distance from the match's end to the text's end
    return seq[L - p + np.arange(num_pred) % p]


def find_draft(seq: np.ndarray, max_ngram: int, num_pred: int) -> np.ndarray:
    """The PLD draft for text ``seq`` (1-D ints): tokens after the earliest earlier occurrence of the longest
    suffix n-gram, n <= max_ngram; empty when nothing matches."""
    hits = longest_suffix_matches(seq, max_ngram)
    return after_first(seq, int(hits[0]), int(hits[-1]), num_pred) if hits.size else seq[:0]


def find_copy(seq: np.ndarray, max_ngram: int, num_pred: int) -> np.ndarray:
    """``copy_latest`` of the longest suffix n-gram's earlier occurrences, n <= max_ngram; empty when nothing
    matches."""
    hits = longest_suffix_matches(seq, max_ngram)
    return copy_latest(seq, int(hits[0]), int(hits[-1]), num_pred) if hits.size else seq[:0]


# what each finder drafts from the matches' earliest and latest end (what ``SuffixIndex`` keeps)
FROM_ENDS = {find_draft: after_first, find_copy: copy_latest}


# Suffix n-grams up to this long, in texts up to this long, are matched through an index kept as the text grows
# (an entry per n per position: its memory grows with the text); longer ones by a scan of the text every step.
INDEX_MAX_NGRAM = 8
INDEX_MAX_TEXT = 32768


class SuffixIndex:
    """Each n-gram's (n <= ``max_ngram``) earliest and latest end position in a growing text, so that a step finds
    the longest earlier occurrence of the text's suffix in ``max_ngram`` lookups instead of a scan of the text: the
    end positions before the text's last are indexed (the suffix itself is not its own match), each once."""

    def __init__(self, max_ngram: int):
        self.max_ngram = max_ngram
        self.ends: list[dict[tuple, list[int]]] = [{} for _ in range(max_ngram + 1)]   # n -> gram -> [first, last]
        self.done = 0                                 # end positions indexed: [0, done)

    def match(self, seq: list[int]) -> list[int] | None:
        """[earliest, latest] end of the longest suffix n-gram's earlier occurrences in ``seq`` (which only grows
        between calls); None when even its last token never occurred before."""
        L = len(seq)
        for e in range(self.done, L - 1):
            for n in range(1, min(self.max_ngram, e + 1) + 1):
                gram = tuple(seq[e - n + 1: e + 1])
                got = self.ends[n].get(gram)
                if got is None:
                    self.ends[n][gram] = [e, e]
                else:
                    got[1] = e
        self.done = max(self.done, L - 1)
        for n in range(min(self.max_ngram, L - 1), 0, -1):
            got = self.ends[n].get(tuple(seq[L - n:]))
            if got is not None:
                return got
        return None


class PromptLookup:
    """Host copy of the committed text, appended incrementally, and the per-step draft: ``find``'s, from the ends a
    ``SuffixIndex`` keeps (``FROM_ENDS``) where the n-grams and the text are short enough, else by ``find`` itself."""

    def __init__(self, req: DraftContext, max_ngram: int, num_pred: int, find=find_draft):
        self.max_ngram, self.num_pred, self.find = max_ngram, num_pred, find
        self.text = np.empty(req.P + len(req.generated) + req.budget + 1, dtype=np.int64)
        self.text[: req.P] = req.prompt
        self.P = req.P
        self.fed = 0                              # generated tokens copied so far
        small = max_ngram <= INDEX_MAX_NGRAM and len(self.text) <= INDEX_MAX_TEXT
        self.from_ends = FROM_ENDS.get(find) if small else None
        self.index = SuffixIndex(max_ngram) if self.from_ends is not None else None
        self.seq: list[int] = self.text[: req.P].tolist() if self.index is not None else []
        if self.index is not None:
            self.index.match(self.seq)            # the prompt indexed now, not in a timed draft

    def propose(self, req: DraftContext, num_pred: int | None = None) -> np.ndarray:
        """The draft for the committed text: up to ``num_pred`` tokens (default: the constructor's)."""
        gen = req.generated
        self.text[self.P + self.fed: self.P + len(gen)] = gen[self.fed:]
        if self.index is not None:
            self.seq.extend(int(t) for t in gen[self.fed:])
        self.fed = len(gen)
        k = min(self.num_pred if num_pred is None else num_pred, req.room - 1)   # a bonus chain (the budget rule)
        L = self.P + self.fed
        if k < 1:
            return self.text[:0]
        if self.index is None:
            return self.find(self.text[:L], self.max_ngram, k)
        hit = self.index.match(self.seq)
        return self.text[:0] if hit is None else self.from_ends(self.text[:L], hit[0], hit[1], k)


@dataclass(frozen=True)
class PLDKnobs(Knobs):
    method = "pld"
    max_ngram: int = knob(3, "longest suffix n-gram matched in the text (prompt lookup, DAS-Wave seeds)",
                          most=MAX_NGRAM)
    num_pred: int = knob(10, "prompt lookup: most tokens drafted per step", most=Most(
        "the context - 1", "the draft and its anchor are verified in one pass", lambda kn, s: s.context - 1))

    def validate(self, R: int) -> "PLDKnobs":
        positive_int(self, "max_ngram", "num_pred")
        return self


class PLDSession(Session):
    def __init__(self, drafter: "PLDDrafter", req: DraftContext):
        super().__init__(drafter, req)
        self.lookup = PromptLookup(req, drafter.knobs.max_ngram, drafter.knobs.num_pred)

    def propose(self) -> Draft:
        return Draft(self.lookup.propose(self.ctx), bonus=True)     # no match: an empty draft, a plain AR step


class PLDDrafter(Drafter):
    name = "pld"
    width_knobs = ("num_pred",)
    session = PLDSession

    def __init__(self, knobs: PLDKnobs):
        self.knobs = knobs
        self.width = knobs.num_pred + 1


register(Method("pld", PLDKnobs, PLDDrafter))
