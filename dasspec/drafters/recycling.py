"""Token Recycling (Luo et al., ACL 2025), verified by the full-depth target.

A successor table ``A`` [vocab, topk] holds, for every token, the ``topk`` most likely next tokens as last
observed by the target.  Each step fills a static draft tree from it - root = the anchor, node = (parent, rank)
-> ``A[token(parent), rank]``, one gather per depth - verifies the whole tree in one pass (``verify_tree``) and
then *recycles* the verifier's logits: ``A[token(i)] = top-k(logits[i])`` for every tree node, accepted or not
(full-row overwrite; when a token appears at several nodes one write wins, as in the reference).  As in the
official code the table starts at zeros, is updated only from tree passes (not from the prompt), and persists
across the requests of a stream ("hot start"): it lives on a per-model state object, is reset by
``reset(model)`` or the ``reset=True`` knob, and is rebuilt if ``topk`` or the device changes.  Unlike the
reference the table is also updated on the final step of a request (the stream keeps that information).

Knobs: ``topk`` (k = 8) and ``tree`` - ``"2.2.2"`` (the official 80-node, depth-6 template) or a list of choices
such as ``[[0], [1], [0, 0]]``; ``reset`` (False).  Near the end of the budget / context the tree is cut to a
breadth-first prefix, so no pass computes nodes that could not be kept.
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor

from ..decoding import Decoding
from ..methods import MethodSpec, positive_int, register
from ..model.looped import LoopedLM
from ..verify import TreeLayout, verify_tree
from .tree import StaticTree, TreeFiller, tree_from_choices

# The official "2.2.2" template (TokenRecycling, model/recycling/tree_template_.py): 80 nodes + root, depth 6,
# 8/21/25/15/8/3 nodes per depth.
TEMPLATES: dict[str, list[list[int]]] = {
    "2.2.2": (
        [[i] for i in range(8)]
        + [[0, i] for i in range(8)] + [[1, i] for i in range(4)] + [[2, i] for i in range(3)]
        + [[3, 0], [3, 1], [4, 0], [5, 0], [6, 0], [7, 0]]
        + [[0, 0, i] for i in range(8)] + [[0, 1, 0], [0, 1, 1], [0, 1, 2], [0, 2, 0], [0, 2, 1]]
        + [[0, 3, 0], [0, 4, 0], [0, 5, 0], [0, 6, 0], [0, 7, 0], [1, 0, 0], [1, 0, 1], [1, 1, 0]]
        + [[2, 0, 0], [3, 0, 0], [4, 0, 0], [5, 0, 0]]
        + [[0, 0, 0, i] for i in range(5)] + [[0, 0, 1, 0], [0, 0, 1, 1], [0, 0, 2, 0], [0, 0, 3, 0]]
        + [[0, 0, 4, 0], [0, 1, 0, 0], [0, 2, 0, 0], [1, 0, 0, 0], [2, 0, 0, 0], [3, 0, 0, 0]]
        + [[0, 0, 0, 0, 0], [0, 0, 0, 0, 1], [0, 0, 0, 0, 2], [0, 0, 0, 1, 0], [0, 0, 0, 2, 0]]
        + [[0, 0, 1, 0, 0], [0, 1, 0, 0, 0], [1, 0, 0, 0, 0]]
        + [[0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 1], [0, 0, 0, 1, 0, 0]]
    ),
}


class SuccessorTable:
    """The persistent adjacency matrix A [vocab, k] (token ids, best first)."""

    def __init__(self, vocab_size: int, k: int, device: torch.device | str):
        self.table = torch.zeros(vocab_size, k, dtype=torch.long, device=device)
        self.requests = 0                     # requests served since the last reset (hot-start depth)

    @property
    def k(self) -> int:
        return self.table.shape[1]

    def update(self, tokens: Tensor, logits: Tensor) -> None:
        """A[tokens[i]] = top-k(logits[i]) for every node i."""
        self.table[tokens] = logits.topk(self.k, dim=-1).indices


_STATE: "weakref.WeakKeyDictionary[LoopedLM, SuccessorTable]" = weakref.WeakKeyDictionary()


def successor_table(model: LoopedLM, k: int) -> SuccessorTable:
    """The model's table, created (zeros) on first use or when k / the device changed."""
    st = _STATE.get(model)
    if st is None or st.k != k or st.table.device != model.device:
        st = _STATE[model] = SuccessorTable(model.config.vocab_size, k, model.device)
    return st


def reset(model: LoopedLM) -> None:
    """Forget the model's successor table (the next request starts cold)."""
    _STATE.pop(model, None)


def resolve_tree(tree) -> StaticTree:
    if isinstance(tree, str):
        if tree not in TEMPLATES:
            raise ValueError(f"unknown tree template {tree!r}; available: {', '.join(TEMPLATES)} "
                             "(or give a list of choices such as [[0], [1], [0, 0]])")
        return tree_from_choices(TEMPLATES[tree])
    if isinstance(tree, StaticTree):
        return tree
    if not isinstance(tree, (list, tuple)) or not tree:
        raise ValueError(f"tree must be a template name or a non-empty list of choices, got {tree!r}")
    return tree_from_choices(tree)


def run_recycling(dec: Decoding, knobs: dict) -> None:
    tree: StaticTree = knobs["tree"]
    if knobs["reset"]:
        reset(dec.model)
    dec.prefill()
    device = dec.tokens.device
    block = dec.model.config.block_size
    if knobs["topk"] > dec.model.config.vocab_size:
        raise ValueError(f"topk {knobs['topk']} exceeds the vocabulary size {dec.model.config.vocab_size}")
    with dec.timer("draft"):
        st = successor_table(dec.model, knobs["topk"])
        shapes: dict[int, tuple[TreeFiller, TreeLayout]] = {}
    while not dec.done:
        with dec.timer("draft"):
            n = dec.n
            # Nodes deeper than budget - 1 could never be kept; rows past the context cannot be computed.
            T = min(tree.nodes_within_depth(dec.budget - 1), block - n)
            shape = shapes.get(T)
            if shape is None:
                sub = tree.truncated(T)
                shape = shapes[T] = (TreeFiller(sub, device), TreeLayout(sub.parents, device=device))
            filler, layout = shape
            nodes = dec.tokens[n: n + T]
            filler.fill(nodes, st.table)
            nodes = nodes.clone()             # verify_tree rewrites the slots with the committed tokens
        verdict = verify_tree(dec, layout)
        with dec.timer("draft"):
            st.update(nodes, verdict.logits)
    st.requests += 1


def _validate(knobs: dict, R: int) -> dict:
    positive_int(knobs, "topk")
    knobs["tree"] = resolve_tree(knobs["tree"])
    if knobs["tree"].max_rank >= knobs["topk"]:
        raise ValueError(f"tree uses successor rank {knobs['tree'].max_rank} but topk is {knobs['topk']}; "
                         f"raise topk to at least {knobs['tree'].max_rank + 1}")
    if not isinstance(knobs["reset"], bool):
        raise ValueError(f"reset must be true or false, got {knobs['reset']!r}")
    return knobs


register(MethodSpec("token-recycling", run_recycling, lambda cfg: {"topk": 8, "tree": "2.2.2", "reset": False},
                    _validate, lambda kn: resolve_tree(kn["tree"]).size,
                    doc="Token Recycling: persistent top-k successor table, static draft tree, tree verification",
                    stateful=True))
