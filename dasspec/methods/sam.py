"""SAM-Decoding (Hu et al., ACL 2025), SAM-only mode, verified by the full-depth target.

A suffix automaton (SAM) over the request's text - prompt + committed tokens, built online, O(1) amortised per
token - tracks the longest suffix of the text that occurred earlier (the *match*: a state and its length).  Each
step transitions the match by the anchor (without committing it), and drafts the tokens that followed the
match's first occurrence: ``min(n_predicts, 1 + floor(alpha * match_len)) - 1`` of them, verified as a chain with
the bonus token.  Where that occurrence is followed by fewer tokens than wanted (a repeat that overlaps the end of
the text) the draft walks on: the match grows by each drafted token and, on reaching the end of the text, is
shortened along its suffix link (``SuffixAutomaton.draft``).  Whenever enough tokens follow, the draft is the
reference's; where they do not, the reference's SAM-only mode drafts only what follows (nothing, for a run of one
token) and its ``to_anc`` (used with auxiliary drafters) trades the long match for a short one with a full
continuation, often a one-token match in the prompt - both would leave loops, common in small models, undrafted.  As in the reference the automaton holds the committed text up to (excluding) the anchor, so a
match always points at an earlier occurrence; after a step the old anchor and the accepted tokens are added.

Optionally a *static* automaton over a corpus (``static_corpus``: a .jsonl file with "text" or "ids" per line,
a .json list of strings / id lists, or a plain-text file = one document; documents are joined with EOS) is
matched too (transitions only, never extended).  When its match minus ``len_bias`` is longer than the dynamic
one, the draft is a tree from the static automaton: best-first over the top-8 transitions of each state by
occurrence count (priority = product of count ratios along the path), at most 8 nodes per depth, as many nodes as
the formula above allows; it is verified as a tree.  The static automaton is built (in the timed region) on a
drafter's first request and kept by that drafter (rebuilt when the file changes), shared read-only by the
drafter's concurrent requests (each keeps its own match); the dynamic one is built per request.

Knobs: ``n_predicts`` (40, verifier positions including the anchor), ``alpha`` (4.0), ``len_threshold`` (1: the
shortest match that drafts; below it the step is plain AR), ``len_bias`` (5) and ``static_corpus`` (None, the
model-agnostic baseline).  Host work is pure Python per committed token (transition + extension), as in the
reference, and is counted in the draft time.
"""

from __future__ import annotations

import heapq
import json
import os
from dataclasses import dataclass, replace
from typing import Iterable, Sequence

from ..engine.drafting import Draft, DraftContext, Drafter, Session, TreeLayout
from . import Method, register
from .knobs import Knobs, Most, brief, knob, positive_int

_MATCH = "no match is longer than the context"

STATIC_TOPK = 8          # K: transitions kept per static state and nodes per depth of a static tree


class SuffixAutomaton:
    """Online suffix automaton over ``text`` (1-based end positions; ``text[0]`` is a sentinel).

    State s: ``nxt[s]`` (token -> state), ``link[s]`` (suffix link), ``length[s]`` (longest string),
    ``endpos[s]`` (end position of its first occurrence).  ``match``/``match_len``: the state and length of the
    longest suffix of the text fed through ``advance`` that occurs in the automaton's text before it."""

    def __init__(self):
        self.nxt: list[dict[int, int]] = [{}]
        self.link = [-1]
        self.length = [0]
        self.endpos = [0]
        self.text: list[int] = [-1]
        self.last = 0
        self.match = 0
        self.match_len = 0

    def extend(self, token: int) -> None:
        """Standard online construction: append ``token`` to the text."""
        nxt, link, length, endpos = self.nxt, self.link, self.length, self.endpos
        self.text.append(token)
        pos = len(self.text) - 1
        cur = len(nxt)
        nxt.append({})
        link.append(0)
        length.append(pos)
        endpos.append(pos)
        p = self.last
        while p != -1 and token not in nxt[p]:
            nxt[p][token] = cur
            p = link[p]
        if p != -1:
            q = nxt[p][token]
            if length[p] + 1 == length[q]:
                link[cur] = q
            else:
                clone = len(nxt)
                nxt.append(dict(nxt[q]))
                link.append(link[q])
                length.append(length[p] + 1)
                endpos.append(endpos[q])
                while p != -1 and nxt[p].get(token) == q:
                    nxt[p][token] = clone
                    p = link[p]
                link[q] = link[cur] = clone
        self.last = cur

    def step(self, state: int, n: int, token: int) -> tuple[int, int]:
        """Match transition: the longest suffix of (matched string + token) present in the automaton."""
        nxt, link = self.nxt, self.link
        while state and token not in nxt[state]:
            state = link[state]
            n = self.length[state]
        if token in nxt[state]:
            return nxt[state][token], n + 1
        return 0, 0

    def walk(self, state: int, n: int, tokens: Iterable[int]) -> tuple[int, int]:
        """The match (state, length) after moving ``(state, n)`` over ``tokens`` (no extension, nothing stored)."""
        for t in tokens:
            state, n = self.step(state, n, t)
        return state, n

    def advance(self, tokens: Iterable[int]) -> None:
        """Move the match over ``tokens`` (no extension)."""
        self.match, self.match_len = self.walk(self.match, self.match_len, tokens)

    def add(self, tokens: Iterable[int]) -> None:
        """Feed tokens: move the match first, then extend, so the match refers to an earlier occurrence."""
        s, m = self.match, self.match_len
        for t in tokens:
            s, m = self.step(s, m, t)
            self.extend(t)
        self.match, self.match_len = s, m

    def draft(self, state: int, k: int) -> list[int]:
        """Up to k tokens read off the text after the first occurrence of the match ``state``: each next token is
        the one that followed the match's first occurrence, and the match then grows by it.  This is exactly the
        continuation of that occurrence while it lasts; when the match reaches the end of the text (a repeat that
        overlaps itself) it is shortened along its suffix link - whose first occurrence ends earlier - and the
        walk goes on, so loops draft as far as they repeat."""
        nxt, link, endpos, text = self.nxt, self.link, self.endpos, self.text
        end = len(text) - 1
        out: list[int] = []
        while state and len(out) < k:
            if endpos[state] == end:
                if link[state] == 0:
                    break
                state = link[state]          # its endpos set is a strict superset, so it ends earlier
            t = text[endpos[state] + 1]
            out.append(t)
            state = nxt[state][t]
        return out


class StaticAutomaton(SuffixAutomaton):
    """A corpus automaton with occurrence counts and per-state top-K transitions (computed on demand)."""

    def __init__(self, docs: Sequence[Sequence[int]], sep: int | None):
        super().__init__()
        for doc in docs:
            for t in doc:
                self.extend(int(t))
            if sep is not None and (not doc or doc[-1] != sep):
                self.extend(sep)
        # cnt[s] = |endpos(s)|: 1 for every non-clone state, summed up the suffix-link tree (longest first).
        cnt = [0] * len(self.nxt)
        for s in range(1, len(self.nxt)):
            if self.length[s] == self.endpos[s]:      # created by extend (its first end position is its length)
                cnt[s] = 1
        for s in sorted(range(1, len(self.nxt)), key=self.length.__getitem__, reverse=True):
            cnt[self.link[s]] += cnt[s]
        self.count = cnt
        self._topk: dict[int, list[tuple[int, int]]] = {}

    def top_next(self, state: int) -> list[tuple[int, int]]:
        """(token, state) transitions of ``state``, most frequent first, at most STATIC_TOPK."""
        top = self._topk.get(state)
        if top is None:
            cnt = self.count
            top = sorted(self.nxt[state].items(), key=lambda kv: -cnt[kv[1]])[:STATIC_TOPK]
            self._topk[state] = top
        return top

    def tree(self, state: int, root: int, size: int) -> tuple[list[int], list[int]]:
        """Best-first draft tree of ``size`` nodes from the match ``state`` (root token = the anchor): a node's
        priority is the product of count(child)/count(parent) along its path; at most STATIC_TOPK per depth.
        Returns (tokens, parents), parents before children."""
        tokens, parents, per_depth = [], [], {}
        heap = [(-1.0, 0, root, state, -1, 0)]       # (-priority, tiebreak, token, state, parent, depth)
        order = 1
        while heap and len(tokens) < size:
            negp, _, tok, s, par, d = heapq.heappop(heap)
            if per_depth.get(d, 0) >= STATIC_TOPK:
                continue
            per_depth[d] = per_depth.get(d, 0) + 1
            me = len(tokens)
            tokens.append(tok)
            parents.append(par)
            total = max(self.count[s], 1)
            for t, c in self.top_next(s):
                heapq.heappush(heap, (negp * self.count[c] / total, order, t, c, me, d + 1))
                order += 1
        return tokens, parents


def load_corpus(path: str, tokenizer) -> list[list[int]]:
    """Documents of a static corpus as token ids (see the module docstring for the formats)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"static_corpus {path!r} is not a file")

    def ids_of(item, where: str) -> list[int]:
        if isinstance(item, dict):
            item = item.get("ids", item.get("text"))
        if isinstance(item, str):
            if tokenizer is None:
                raise ValueError(f"{where}: text documents need the model's tokenizer (give token ids instead)")
            return list(tokenizer.encode(item))
        if isinstance(item, list) and all(isinstance(t, int) for t in item):
            return item
        raise ValueError(f"{where}: expected a string, a list of token ids or an object with 'text' / 'ids'")

    if path.endswith(".jsonl"):
        with open(path) as f:
            return [ids_of(json.loads(line), f"{path}:{i + 1}") for i, line in enumerate(f) if line.strip()]
    if path.endswith(".json"):
        with open(path) as f:
            data = json.load(f)
        if not isinstance(data, list):
            raise ValueError(f"{path}: expected a JSON list of documents")
        return [ids_of(d, f"{path}[{i}]") for i, d in enumerate(data)]
    with open(path) as f:
        return [ids_of(f.read(), path)]


@dataclass(frozen=True)
class SAMKnobs(Knobs):
    method = "sam"
    n_predicts: int = knob(40, "SAM: most verifier positions per step, the anchor included", most=Most(
        "the context", "a draft and its anchor are verified in one pass", lambda kn, s: s.context))
    alpha: float = knob(4.0, "SAM: draft length per matched token", most=Most(
        "n_predicts", "a draft is cut to n_predicts - 1 tokens, so a longer one per matched token changes nothing",
        lambda kn, s: kn.n_predicts))
    len_threshold: int = knob(1, "SAM: shortest match that drafts (below it: a plain AR step)", most=Most(
        "the context", _MATCH, lambda kn, s: s.context))
    len_bias: int = knob(5, "SAM: how much longer the static match must be to win over the dynamic one", most=Most(
        "the context", _MATCH, lambda kn, s: s.context))
    static_corpus: str | None = knob(None, "SAM: a corpus file (.jsonl / .json / text) for the static automaton; "
                                     "one named in a checkpoint's generation_config.json lies inside it", path=True)

    def validate(self, R: int) -> "SAMKnobs":
        positive_int(self, "n_predicts", "len_threshold")
        positive_int(self, "len_bias", minimum=0)
        a = self.alpha
        if isinstance(a, bool) or not isinstance(a, (int, float)) or not a > 0:
            raise ValueError(f"alpha must be a number > 0, got {brief(a)}")
        c = self.static_corpus
        if c is not None:
            if not isinstance(c, (str, os.PathLike)) or not os.path.isfile(c):
                raise ValueError(f"static_corpus must be a path to a corpus file, got {brief(c)}")
            return replace(self, static_corpus=os.fspath(c))
        return self


class SAMDrafter(Drafter):
    """Owns the static corpus automaton (built on its first request, rebuilt when the file or tokenizer changes),
    shared read-only by its requests: each session keeps its own match in it."""

    name = "sam"
    width_knobs = ("n_predicts",)

    def __init__(self, knobs: SAMKnobs):
        self.knobs = knobs
        self.width = knobs.n_predicts
        self._static: tuple[tuple, StaticAutomaton] | None = None

    def static_automaton(self, tokenizer, eos) -> StaticAutomaton:
        path = self.knobs.static_corpus
        st = os.stat(path)
        key = (os.path.abspath(path), st.st_mtime_ns, st.st_size, tokenizer, eos)
        if self._static is None or self._static[0] != key:
            self._static = key, StaticAutomaton(load_corpus(path, tokenizer), eos[0] if eos else None)
        return self._static[1]

    def start(self, req: DraftContext) -> "SAMSession":
        return SAMSession(self, req)


class SAMSession(Session):
    def __init__(self, drafter: SAMDrafter, req: DraftContext):
        super().__init__(drafter, req)
        prompt = list(req.prompt)
        self.dyn = SuffixAutomaton()
        self.dyn.add(prompt)
        self.static = drafter.static_automaton(req.tokenizer, req.config.eos_token_id) if drafter.knobs.static_corpus else None
        self.s_match = self.s_len = 0         # this request's match in the shared static automaton
        if self.static is not None:
            self.s_match, self.s_len = self.static.walk(0, 0, prompt)
        self.fed = 0                          # generated tokens already in the automata (all but the anchor)

    def propose(self) -> Draft:
        req, kn, dyn, static = self.ctx, self.drafter.knobs, self.dyn, self.static
        gen = req.generated
        new = gen[self.fed: len(gen) - 1]
        dyn.add(new)
        if static is not None:
            self.s_match, self.s_len = static.walk(self.s_match, self.s_len, new)
        self.fed = len(gen) - 1
        anchor = gen[-1]
        s_d, m_d = dyn.step(dyn.match, dyn.match_len, anchor)
        s_s, m_s = static.step(self.s_match, self.s_len, anchor) if static is not None else (0, 0)
        use_static = static is not None and m_s - kn.len_bias > m_d
        m = m_s if use_static else m_d
        # Every node of a tree, and a bonus chain's inputs, lie at depth <= size - 1 <= room - 1 (the budget rule).
        size = min(kn.n_predicts, 1 + int(m * kn.alpha), req.room)
        if m < kn.len_threshold or size <= 1:
            return Draft()
        if use_static:
            toks, parents = static.tree(s_s, anchor, size)
            return Draft(toks[1:], layout=TreeLayout(parents, device=req.device)) if len(toks) > 1 else Draft()
        return Draft(dyn.draft(s_d, size - 1), bonus=True)


register(Method("sam", SAMKnobs, SAMDrafter))
