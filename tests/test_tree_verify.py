"""Tree verification (``engine.core.verify`` with a ``TreeLayout``): the layout (mask, depths, candidate paths) and greedy acceptance against
brute force; one tree pass gives every node the logits of its root path run as a plain sequence; the compacted
cache equals the cache of AR decoding the same tokens; the stop rule applies inside the committed chunk."""

from __future__ import annotations

import random

import pytest
import torch

import dasspec
from dasspec.engine.drafting.draft import Draft, TreeLayout
from dasspec.engine.core.verify import accept
from dasspec.testing import Stepper, random_model


def step(dec: Stepper, draft: Draft = Draft()):
    """One engine step of the request with this draft (an empty draft is an AR step)."""
    return dec.step(draft)


def random_parents(rng: random.Random, T: int) -> list[int]:
    return [-1] + [rng.randrange(i) for i in range(1, T)]


def ancestors(parents: list[int], i: int) -> list[int]:
    out = [i]
    while parents[out[-1]] != -1:
        out.append(parents[out[-1]])
    return out[::-1]


@pytest.mark.parametrize("seed", range(20))
def test_layout_matches_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    T = rng.randrange(1, 30)
    parents = random_parents(rng, T)
    lay = TreeLayout(parents)
    for i in range(T):
        anc = set(ancestors(parents, i))
        assert lay.mask[i].tolist() == [j in anc for j in range(T)]
        assert int(lay.depth[i]) == len(anc) - 1
    leaves = [i for i in range(T) if i not in parents]
    got = [[j for j in row if j >= 0] for row in lay.paths.tolist()]
    assert got == [ancestors(parents, leaf) for leaf in leaves]
    assert all(row[-1] == -1 or len([j for j in row if j >= 0]) == lay.paths.shape[1] for row in lay.paths.tolist())
    # explicit candidate leaves (Lookahead's window rides along but is not a candidate)
    chosen = [i for i in range(T) if rng.random() < 0.3]
    lay2 = TreeLayout(parents, leaves=chosen)
    got2 = [[j for j in row if j >= 0] for row in lay2.paths.tolist()]
    assert got2 == ([ancestors(parents, i) for i in chosen] or [[0]])


def test_chain_flag_and_bad_trees() -> None:
    assert TreeLayout.chain(5).is_chain and TreeLayout.chain(1).is_chain
    assert not TreeLayout([-1, 0, 0]).is_chain
    assert not TreeLayout([-1, 0, 1], leaves=[1]).is_chain
    with pytest.raises(ValueError, match="root"):
        TreeLayout([0, 0])
    with pytest.raises(ValueError, match="parent"):
        TreeLayout([-1, 2, 0])


def test_chain_and_fork_layouts_are_shared_per_shape() -> None:
    """chain / fork are built once per (shape, device) and reused by every decoder; fork's second chain hangs
    off the last shared proposal."""
    assert TreeLayout.chain(6) is TreeLayout.chain(6) and TreeLayout.chain(6) is not TreeLayout.chain(7)
    assert TreeLayout.chain(3, "cpu") is TreeLayout.chain(3, torch.device("cpu"))
    fork = TreeLayout.fork(4, 2, 3)
    assert fork.parents == (-1, 0, 1, 2, 3, 2, 5, 6) and fork is TreeLayout.fork(4, 2, 3)
    assert fork.paths.tolist() == [[0, 1, 2, 3, 4, -1], [0, 1, 2, 5, 6, 7]]
    assert TreeLayout.fork(3, 0, 2).parents == (-1, 0, 1, 2, 0, 4)          # nothing shared: both from the anchor
    assert TreeLayout.fork(2, 2, 2).is_chain                                 # the second chain extends the first
    with pytest.raises(ValueError, match="shared prefix"):
        TreeLayout.fork(2, 3, 1)


@pytest.mark.parametrize("seed", range(40))
def test_accept_matches_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    T = rng.randrange(1, 25)
    parents = random_parents(rng, T)
    lay = TreeLayout(parents)
    V = rng.choice([2, 3, 5])                       # tiny vocabularies: many matches and duplicate siblings
    toks = torch.tensor([rng.randrange(V) for _ in range(T)])
    pred = torch.tensor([rng.randrange(V) for _ in range(T)])
    acc, best = accept(toks, pred, lay.paths)
    brute = []
    for row in lay.paths.tolist():
        path = [j for j in row if j >= 0]
        a = 0
        while a + 1 < len(path) and int(toks[path[a + 1]]) == int(pred[path[a]]):
            a += 1
        brute.append(a)
    assert int(acc) == max(brute)
    assert int(best) == brute.index(max(brute))   # first longest path wins


def _decoding(model, prompt, max_new, init_scale, seed=0, width=16, stop_ids=()) -> Stepper:
    return Stepper(model, prompt, max_new, init_scale=init_scale, state_seed=seed, width=width, stop_ids=stop_ids)


def _tree_with_truth(truth: list[int], V: int) -> tuple[list[int], list[int], list[int]]:
    """A tree whose first branch is wrong at once and whose *second* branch spells truth[0..2] (so the accepted
    path is not the first rows and compaction must gather), with wrong siblings and a wrong child after the
    accepted path.  ``truth``: the 4 AR tokens after the anchor.  Returns (parents, tokens of nodes 1.., the
    accepted path's node indices)."""
    wrong = [(t + 1) % V for t in truth]
    #  node:      0   1  2  3  4  5  6  7  8
    parents = [-1, 0, 0, 1, 2, 2, 4, 6, 4]
    toks = [wrong[0], truth[0], truth[1], truth[1], wrong[1], truth[2], wrong[3], wrong[2]]
    return parents, toks, [0, 2, 4, 6]


@pytest.mark.parametrize("family", ["huginn", "raven-llama", "raven-olmo"])
@pytest.mark.parametrize("init_scale", [0.0, 1.0])
def test_tree_pass_equals_sequential_decoding(family: str, init_scale: float) -> None:
    model = random_model(family, seed=1)
    V = model.config.vocab_size
    prompt = [5, 9, 14, 9, 5, 22, 31]
    ar = dasspec.generate(model, prompt, "ar", max_new_tokens=8, init_scale=init_scale, eos=False).tokens
    # AR reference cache after committing the anchor + 4 more tokens.
    ref = _decoding(model, prompt, 8, init_scale)
    ref.prefill()
    for _ in range(4):
        step(ref)
    assert ref.generated == ar[:5]

    parents, toks, path = _tree_with_truth(ar[1:5], V)
    dec = _decoding(model, prompt, 8, init_scale)
    dec.prefill()
    n = dec.n
    tree_tokens = dec.req.tokens[n: n + 1].tolist() + toks
    verdict = step(dec, Draft(toks, layout=TreeLayout(parents)))
    with torch.inference_mode():
        # every node's logits = the last logits of a plain forward over prompt + its root path
        for i in range(len(parents)):
            seq = prompt + [tree_tokens[j] for j in ancestors(parents, i)]
            full = model(torch.tensor([seq]), init_scale=init_scale, seed=0)[0, -1]
            torch.testing.assert_close(verdict.logits[i], full, rtol=1e-4, atol=1e-4)
    assert verdict.path == path and verdict.accepted == 3
    assert dec.generated == ar[:5]                     # anchor + 3 accepted + the target's bonus token
    assert dec.req.tokens[: dec.n + 1].tolist() == prompt + ar[:5]
    assert dec.n == ref.n
    for a, b in zip(dec.rows(), ref.rows()):           # compacted rows (gathered through the block table)
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    s = dec.stats
    assert s.proposed == [len(parents) - 1] and s.accepted == [3] and s.target_tokens == [1]
    assert s.verify_updates == dec.engine.R * len(parents)
    # decoding continues from the compacted cache exactly like AR
    while not dec.done:
        step(dec)
    assert dec.generated == ar


def test_stop_rule_inside_tree_chunk() -> None:
    model = random_model("raven-olmo", seed=1)
    V = model.config.vocab_size
    prompt = [5, 9, 14, 9, 5, 22, 31]
    ar = dasspec.generate(model, prompt, "ar", max_new_tokens=8, init_scale=0.0, eos=False).tokens
    parents, toks, _ = _tree_with_truth(ar[1:5], V)
    j = next(j for j in (2, 3, 4) if ar[j] not in ar[:j])   # a stop token first committed inside the chunk
    dec = _decoding(model, prompt, 8, 0.0, stop_ids=[ar[j]])
    dec.prefill()
    verdict = step(dec, Draft(toks, layout=TreeLayout(parents)))
    assert dec.done and dec.generated == ar[: j + 1]   # the scheduler's stop rule cut the committed chunk
    assert verdict.kept == 4                           # (the verifier commits the whole accepted path)
    assert dec.stats.accepted[-1] == min(3, j) and dec.stats.target_tokens[-1] == 0
    assert dec.stats.stop_reason == "eos"


def test_a_tree_deeper_than_the_budget_is_refused() -> None:
    """The budget rule (engine/drafting/draft.py): every verifier input lies at depth <= room - 1, so a tree that reaches
    past the tokens max_new_tokens still allows is the drafter's error, named - never computed and dropped."""
    model = random_model("raven-olmo", seed=1)
    parents, toks, _ = _tree_with_truth([3, 4, 5, 6], model.config.vocab_size)     # depth 4
    dec = _decoding(model, [5, 9, 14], 4, 0.0)
    dec.prefill()                                                # room: 3 more tokens
    with pytest.raises(ValueError, match="depth 4 below the anchor, but only 3 more tokens"):
        step(dec, Draft(toks, layout=TreeLayout(parents)))
    assert step(dec, Draft(toks[:2], layout=TreeLayout(parents[:3]))) is not None   # depth 1: fine


@pytest.mark.parametrize("seed", range(20))
def test_accept_on_a_chain_whose_last_proposal_is_no_input(seed: int) -> None:
    """The paper's chain block feeds [anchor, y_1 .. y_{w-1}] and tests y_1 .. y_w: the target's tokens cover
    nodes 0 .. w-1 only, and acceptance may still reach node w."""
    rng = random.Random(seed)
    w = rng.randrange(0, 10)
    toks = torch.tensor([rng.randrange(3) for _ in range(w + 1)])
    pred = torch.tensor([rng.randrange(3) for _ in range(max(w, 1))])
    acc, best = accept(toks, pred, TreeLayout.chain(w + 1).paths)
    a = 0
    while a < w and int(toks[a + 1]) == int(pred[a]):
        a += 1
    assert (int(acc), int(best)) == (a, 0)
