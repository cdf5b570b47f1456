"""The model-agnostic drafters' building blocks against brute-force versions: PLD's matcher, the suffix automata
(match, continuation, occurrence counts, static trees), Token Recycling's tree layout / fill / table, Lookahead's
pass layout (baselines.md sec. 4.3), n-gram pool and window; plus registration, knob validation and hot start."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import dasspec
from dasspec.engine.drafting.draft import TreeLayout
from dasspec.methods import lookahead as la
from dasspec.methods import recycling as tr
from dasspec.methods.pld import find_copy, find_draft
from dasspec.methods.sam import STATIC_TOPK, StaticAutomaton, SuffixAutomaton
from dasspec.methods.tree import TreeFiller, tree_from_choices
from dasspec.methods import get_method, method_names
from dasspec.testing import random_model


def random_text(rng: random.Random, n: int, V: int) -> list[int]:
    # small vocabularies and copied spans make repeats (and so matches) common
    out: list[int] = []
    while len(out) < n:
        if out and rng.random() < 0.3:
            i = rng.randrange(len(out))
            out += out[i: i + rng.randrange(1, 6)]
        else:
            out.append(rng.randrange(V))
    return out[:n]


def occurrences(text: list[int], w: list[int]) -> list[int]:
    """1-based end positions of w in text."""
    n = len(w)
    return [i + n for i in range(len(text) - n + 1) if text[i: i + n] == w]


# --- PLD -----------------------------------------------------------------------------------------------------

def pld_brute(seq: list[int], max_ngram: int, k: int) -> list[int]:
    L = len(seq)
    for n in range(min(max_ngram, L - 1), 0, -1):
        pattern = seq[L - n:]
        for idx in range(L - n):                    # every earlier occurrence, earliest first
            if seq[idx: idx + n] == pattern:
                return seq[idx + n: idx + n + k]
    return []


def copy_brute(seq: list[int], max_ngram: int, k: int) -> list[int]:
    """The latest earlier occurrence of the longest suffix n-gram, then copy token by token from right after it,
    reading the draft itself once the copy runs past the end of the text (LZ77)."""
    L = len(seq)
    for n in range(min(max_ngram, L - 1), 0, -1):
        pattern = seq[L - n:]
        for idx in range(L - n - 1, -1, -1):        # every earlier occurrence, latest first
            if seq[idx: idx + n] == pattern:
                ext = list(seq)
                for i in range(k):
                    ext.append(ext[idx + n + i])
                return ext[L:]
    return []


@pytest.mark.parametrize("find, brute", [(find_draft, pld_brute), (find_copy, copy_brute)], ids=["pld", "copy"])
@pytest.mark.parametrize("seed", range(30))
def test_lookup_matchers_match_brute_force(find, brute, seed: int) -> None:
    rng = random.Random(seed)
    seq = random_text(rng, rng.randrange(1, 60), rng.choice([2, 4, 8, 30]))
    for max_ngram in (1, 2, 3, 5):
        for k in (1, 3, 10):
            got = find(np.array(seq, dtype=np.int64), max_ngram, k).tolist()
            assert got == brute(seq, max_ngram, k), (seq, max_ngram, k)


@pytest.mark.parametrize("find", [find_draft, find_copy], ids=["pld", "copy"])
@pytest.mark.parametrize("seed", range(12))
def test_prompt_lookup_drafts_as_its_matcher_while_the_text_grows(find, seed: int) -> None:
    """A request's prompt lookup keeps an index of its text's n-grams as it grows (several tokens a step, as a
    verified block commits): every step's draft equals the matcher's on the whole text, for n-grams short enough
    to index and past that (fails when the index counts the text's own suffix as an earlier occurrence, or forgets
    where an n-gram last ended)."""
    from types import SimpleNamespace

    from dasspec.methods.pld import INDEX_MAX_NGRAM, PromptLookup
    rng = random.Random(seed)
    text = random_text(rng, 240, rng.choice([2, 4, 8, 30]))
    for max_ngram in (1, 2, 3, 5, INDEX_MAX_NGRAM, INDEX_MAX_NGRAM + 1):
        P = rng.randrange(1, 20)
        req = SimpleNamespace(P=P, prompt=text[:P], generated=[], budget=len(text) - P, room=len(text) - P)
        lookup = PromptLookup(req, max_ngram, 10, find)
        assert (lookup.index is not None) == (max_ngram <= INDEX_MAX_NGRAM)
        while P + len(req.generated) < len(text):
            k = rng.randrange(1, 12)
            req.room = rng.choice([len(text), rng.randrange(1, 6)])         # the budget rule may cut the chain
            got = lookup.propose(req, k).tolist()
            whole = np.array(text[: P + len(req.generated)], dtype=np.int64)
            want = find(whole, max_ngram, min(k, req.room - 1)).tolist() if req.room > 1 else []
            assert got == want, (max_ngram, len(whole), k, req.room)
            req.generated = text[P: P + len(req.generated) + rng.randrange(0, 6)]     # a step may commit nothing


def test_copy_extends_runs_and_cycles() -> None:
    assert find_copy(np.array([7, 1, 1, 1]), 3, 6).tolist() == [1] * 6
    assert find_copy(np.array([9, 4, 5, 6, 4, 5, 6]), 3, 7).tolist() == [4, 5, 6, 4, 5, 6, 4]


# --- SAM -----------------------------------------------------------------------------------------------------

def longest_earlier_suffix(s: list[int], t: list[int]) -> int:
    """Length of the longest suffix of s that occurs in t."""
    best = 0
    for n in range(1, len(s) + 1):
        if occurrences(t, s[len(s) - n:]):
            best = n
        else:
            break          # a suffix that does not occur has no longer suffix that does
    return best


def sam_draft_brute(text: list[int], match: list[int], k: int) -> list[int]:
    """Next token = the one after the first occurrence of the match, which then grows by it; a match whose first
    occurrence ends the text loses leading tokens until one ends earlier."""
    out, s = [], list(match)
    while s and len(out) < k:
        while s and occurrences(text, s)[0] == len(text):
            s = s[1:]
        if not s:
            break
        nxt = text[occurrences(text, s)[0]]
        out.append(nxt)
        s.append(nxt)
    return out


@pytest.mark.parametrize("seed", range(15))
def test_suffix_automaton_matches_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    V = rng.choice([2, 3, 6, 20])
    text = random_text(rng, 70, V)
    sam = SuffixAutomaton()
    for i, t in enumerate(text):
        # peek with the next token (the anchor): match of text[:i] + [t] against text[:i], not committed
        s, m = sam.step(sam.match, sam.match_len, t)
        seen = text[:i]
        assert m == longest_earlier_suffix(seen + [t], seen)
        if m:
            assert sam.endpos[s] == occurrences(seen, (seen + [t])[-m:])[0]   # first occurrence
            for k in (1, 4, 40):
                assert sam.draft(s, k) == sam_draft_brute(seen, (seen + [t])[-m:], k)
        sam.add([t])
        assert (sam.match, sam.match_len) == (s, m)
    assert sam.text[1:] == text


def test_sam_drafts_through_loops() -> None:
    """The reference continuation where it is long enough; a run keeps drafting past the end of the text."""
    sam = SuffixAutomaton()
    sam.add([5, 6, 7, 8, 9, 10, 5, 6])
    s, m = sam.step(sam.match, sam.match_len, 7)
    assert m == 3 and sam.draft(s, 3) == [8, 9, 10]
    sam = SuffixAutomaton()
    sam.add([5, 6, 7] + [9] * 4)
    s, m = sam.step(sam.match, sam.match_len, 9)
    assert m == 4 and sam.draft(s, 6) == [9] * 6


def test_static_automaton_counts_and_trees() -> None:
    rng = random.Random(0)
    docs = [random_text(rng, rng.randrange(5, 40), 5) for _ in range(6)]
    sep = 99
    sam = StaticAutomaton(docs, sep)
    text = sam.text[1:]
    assert text == [t for d in docs for t in d + [sep]]
    for _ in range(200):
        i = rng.randrange(len(text))
        w = text[i: i + rng.randrange(1, 6)]
        s = 0
        for t in w:
            s = sam.nxt[s][t]
        assert sam.count[s] == len(occurrences(text, w))
        top = sam.top_next(s)
        counts = [sam.count[c] for _, c in top]
        every = sorted((len(occurrences(text, w + [t])) for t in sam.nxt[s]), reverse=True)
        assert counts == every[:STATIC_TOPK]
        # a best-first tree: parents first, <= K nodes per depth, every path is a corpus string after w
        toks, parents = sam.tree(s, w[-1], 20)
        assert parents[0] == -1 and toks[0] == w[-1] and len(toks) <= 20
        assert all(0 <= p < j for j, p in enumerate(parents[1:], 1))
        depth = [0] * len(toks)
        for j in range(1, len(toks)):
            depth[j] = depth[parents[j]] + 1
            path, a = [], j
            while a > 0:
                path.append(toks[a])
                a = parents[a]
            assert occurrences(text, w + path[::-1]), "a tree path that never occurs in the corpus"
        assert max(np.bincount(depth)) <= STATIC_TOPK
        if len(toks) > 1 and top:
            assert toks[1] == top[0][0]                  # the most frequent continuation comes first


# --- Token Recycling -----------------------------------------------------------------------------------------

def test_tree_from_choices_layout_and_errors() -> None:
    tree = tr.resolve_tree("2.2.2")
    assert tree.size == 81 and [hi - lo for lo, hi in tree.levels] == [8, 21, 25, 15, 8, 3]
    for i, c in enumerate(tree.choices, 1):
        parent = 0 if len(c) == 1 else tree.choices.index(c[:-1]) + 1
        assert tree.parents[i] == parent and tree.ranks[i] == c[-1]
        lo, hi = tree.levels[len(c) - 1]
        assert lo <= i < hi
    assert tree.truncated(9).size == 9 and tree.nodes_within_depth(1) == 9 and tree.nodes_within_depth(0) == 1
    for bad, msg in (([[0], [0]], "duplicate"), ([[0, 1]], "parent"), ([[-1]], "rank"), ([[]], "non-empty")):
        with pytest.raises(ValueError, match=msg):
            tree_from_choices(bad)


@pytest.mark.parametrize("seed", range(5))
def test_static_tree_fill_matches_recursion(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    V, k = 13, 8
    table = torch.randint(0, V, (V, k), generator=g)
    tree = tr.resolve_tree("2.2.2")
    for size in (tree.size, 30, 1):
        sub = tree.truncated(size)
        toks = torch.zeros(sub.size, dtype=torch.long)
        toks[0] = 5
        TreeFiller(sub, "cpu").fill(toks, table)

        def token(path: tuple[int, ...]) -> int:
            return 5 if not path else int(table[token(path[:-1]), path[-1]])

        assert toks.tolist() == [5] + [token(c) for c in sub.choices]


def test_successor_table_update_and_hot_start() -> None:
    st = tr.SuccessorTable(11, 3, "cpu")
    logits = torch.randn(4, 11)
    st.update(torch.tensor([2, 7, 4, 9]), logits)
    for row, t in enumerate([2, 7, 4, 9]):
        assert st.table[t].tolist() == logits[row].argsort(descending=True)[:3].tolist()

    model = random_model("raven-olmo", seed=2)
    prompt = [3, 4, 5, 6, 3, 4]
    drafter = dasspec.build_drafter(model, "token-recycling")
    dasspec.generate(model, prompt, max_new_tokens=12, eos=False, drafter=drafter)
    table = drafter.table
    assert table.requests == 1 and int(table.table.count_nonzero()) > 0
    snapshot = table.table.clone()
    dasspec.generate(model, prompt, max_new_tokens=12, eos=False, drafter=drafter)
    assert drafter.table is table and table.requests == 2                   # kept across requests
    assert not torch.equal(snapshot, table.table)                          # and still learning
    dasspec.generate(model, prompt, "token-recycling", max_new_tokens=12, eos=False)
    assert drafter.table is table and table.requests == 2                   # a call without it: its own drafter
    fresh = dasspec.build_drafter(model, "token-recycling", {"reset": True})
    for _ in range(2):
        dasspec.generate(model, prompt, max_new_tokens=12, eos=False, drafter=fresh)
        assert fresh.table.requests == 1                                    # reset knob: every request cold
    drafter.reset()
    assert drafter.table is None
    dasspec.generate(model, prompt, max_new_tokens=12, eos=False, drafter=drafter)
    assert drafter.table.requests == 1
    assert get_method("token-recycling").stateful and drafter.stateful


# --- Lookahead -----------------------------------------------------------------------------------------------

def lookahead_brute(W: int, N: int, g: int) -> tuple[list[list[bool]], list[int]]:
    """Visibility and position offsets written straight from baselines.md sec. 4.3."""
    nodes = [("w", 0, i) for i in range(W)]                       # block 0: root + level 0
    nodes += [("w", l, i) for l in range(1, N - 1) for i in range(W)]
    nodes += [("g", c, j) for c in range(g) for j in range(N - 1)]

    def sees(a, b) -> bool:
        (ka, la_, ia), (kb, lb, ib) = a, b
        if kb == "w" and lb == 0 and ib == 0:
            return True                                          # everyone sees the root
        if ka == "w":
            if kb != "w":
                return False
            if lb == 0:
                return ib <= ia                                  # block 0 up to my column
            return ib == ia and 1 <= lb <= la_                   # my column at levels 1..mine
        if kb == "g":
            return lb == la_ and ib <= ia                        # my own n-gram's prefix
        return False

    vis = [[sees(a, b) for b in nodes] for a in nodes]
    pos = [l + i if k == "w" else 1 + i for k, l, i in nodes]
    return vis, pos


@pytest.mark.parametrize("W,N,g", [(1, 2, 0), (3, 2, 2), (4, 3, 1), (5, 4, 3), (7, 5, 7)])
def test_lookahead_layout_matches_section_4_3(W: int, N: int, g: int) -> None:
    parents, leaves = la.lookahead_parents(W, N, g)
    lay = TreeLayout(parents, leaves=leaves)
    vis, pos = lookahead_brute(W, N, g)
    assert lay.mask.tolist() == vis
    assert lay.depth.tolist() == pos
    # every node's visible context is a proper causal chain: positions 0..pos, each exactly once
    for i in range(lay.size):
        seen = sorted(lay.depth[lay.mask[i]].tolist())
        assert seen == list(range(pos[i] + 1))
    cands = [[j for j in row if j >= 0] for row in lay.paths.tolist()]
    base = W * (N - 1)
    expect = [[0] + list(range(base + c * (N - 1), base + (c + 1) * (N - 1))) for c in range(g)] or [[0]]
    assert cands == expect


def test_ngram_pool_is_lru_per_key() -> None:
    rng = random.Random(0)
    pool, brute = la.NgramPool(3), {}
    for _ in range(500):
        key, gram = rng.randrange(4), tuple(rng.randrange(3) for _ in range(2))
        pool.insert(key, gram)
        lst = brute.setdefault(key, [])
        if gram in lst:
            lst.remove(gram)
        lst.append(gram)
        del lst[:-3]
        assert pool.get(key) == lst
    assert pool.get(99) == []


def test_lookahead_window_update() -> None:
    W, N = 4, 4
    dec = type("D", (), {})()
    dec.P = 5
    dec.prompt = [10, 11, 12, 13, 14]
    dec.device = torch.device("cpu")
    st = la.LookaheadState(dec, W, N, G=2, pool_from_prompt=True)
    assert st.pool.get(10) == [(11, 12, 13)] and st.pool.get(11) == [(12, 13, 14)]
    win0 = st.window.copy()
    assert win0.shape == (N - 1, W) and set(win0.reshape(-1).tolist()) <= {10, 11, 12, 13, 14}
    for step in range(3):
        before = st.window.copy()
        top = [100 + 10 * step + i for i in range(W)]
        st.update(root=7, top=top)
        assert st.window[:-1].tolist() == before[1:].tolist() and st.window[-1].tolist() == top
        if step < N - 2:                     # warm-up: no pooling until levels 1..N-2 hold model outputs
            assert st.pool.get(7) == []
    # the third update pooled column N-grams: key level0[i] (the root for column 0)
    keys = [7] + before[0, 1:].tolist()
    for i, key in enumerate(keys):
        assert tuple(before[1:, i].tolist()) + (top[i],) in st.pool.get(key)


# --- registry and knobs --------------------------------------------------------------------------------------

def test_methods_registered_with_knobs_and_validation() -> None:
    for name in ("pld", "lookahead", "token-recycling", "sam"):
        assert name in method_names()
    model = random_model("huginn")
    bad = [("pld", {"max_ngram": 0}, "max_ngram"), ("pld", {"num_pred": "x"}, "num_pred"),
           ("lookahead", {"ngram": 1}, "ngram"), ("lookahead", {"window": -2}, "window"),
           ("lookahead", {"guess_set": 0}, "guess_set"), ("lookahead", {"pool_from_prompt": "yes"}, "pool_from_prompt"),
           ("token-recycling", {"topk": 4}, "topk"), ("token-recycling", {"tree": "9.9"}, "tree template"),
           ("token-recycling", {"reset": 1}, "reset"), ("token-recycling", {"topk": 200}, "vocabulary"),
           ("sam", {"alpha": 0}, "alpha"), ("sam", {"n_predicts": 0}, "n_predicts"),
           ("sam", {"len_bias": -1}, "len_bias"), ("sam", {"static_corpus": "/nonexistent.jsonl"}, "static_corpus"),
           ("pld", {"window": 3}, "does not take window")]
    for method, knobs, msg in bad:
        with pytest.raises(ValueError, match=msg):
            dasspec.generate(model, [2, 3, 4], method, max_new_tokens=4, **knobs)


def test_cli_parses_baseline_methods_and_knobs() -> None:
    from dasspec.cli import build_parser, knobs_from_args
    p = build_parser()
    args = p.parse_args(["generate", "--method", "token-recycling", "--set", "tree=[[0],[1],[0,0]]",
                         "--set", "topk=2"])
    assert args.method == "token-recycling"
    assert knobs_from_args(args) == {"tree": [[0], [1], [0, 0]], "topk": 2}
    for name in ("pld", "lookahead", "sam"):
        assert p.parse_args(["generate", "--method", name]).method == name


@pytest.mark.parametrize("family", ["ouro", "nanbeige"])
def test_self_speculations_aligned_draft_is_the_target_run_d_steps_deep(family):
    """With aligned reads a self-speculation draft is the model cut to its first d steps (no coda: its readout reads
    no deeper K/V): each request's first block of a batch equals a greedy decode at num_steps = d after its first
    token (fails when the draft's steps, run in one call, start at another depth or stop short)."""
    model = random_model(family, seed=3, mean_recurrence=4, n_core=2)
    prompts = [[5 + i, 9, 11 + 2 * i, 4] * (2 + i) for i in range(3)]
    res = dasspec.generate_batch(model, prompts, "self-spec", max_new_tokens=8, eos=False, trace=True,
                                 draft_depth=2, block=3)
    for p, r in zip(prompts, res):
        draft = [int(t) for t in r.trace[0][0].tokens]
        want = dasspec.generate(model, p + [r.tokens[0]], "ar", num_steps=2, max_new_tokens=3, eos=False).tokens
        assert draft == want
