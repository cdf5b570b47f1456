"""Token Recycling (Luo et al., ACL 2025), verified by the full-depth target.

A successor table ``A`` [vocab, topk] holds, for every token, the ``topk`` most likely next tokens as last
observed by the target.  Each step fills a static draft tree from it - root = the anchor, node = (parent, rank)
-> ``A[token(parent), rank]``, one gather per depth - verifies the whole tree in one pass (``verify_tree``) and
then *recycles* the verifier's logits: ``A[token(i)] = top-k(logits[i])`` for every tree node, accepted or not
(full-row overwrite; when a token appears at several nodes one write wins, as in the reference).  As in the
official code the table starts at zeros, is updated only from tree passes (not from the prompt), and persists
across the requests of a stream ("hot start"): it lives on the drafter object, so a caller who keeps one drafter
for a stream of requests (``dasspec.build_drafter(model, "token-recycling")`` passed as ``generate(drafter=...)``;
the benchmark does this) gets the hot start, and ``generate(method="token-recycling")`` without a drafter starts
cold.  ``reset()`` or the ``reset=True`` knob forgets it; it is rebuilt if the device or vocabulary changes.
Unlike the reference the table is also updated on the final step of a request (the stream keeps that
information).

Knobs: ``topk`` (k = 8) and ``tree`` - ``"2.2.2"`` (the official 80-node, depth-6 template) or a list of choices
such as ``[[0], [1], [0, 0]]``; ``reset`` (False).  Near the end of the budget the tree is cut to a breadth-first
prefix, so no pass computes nodes that could not be kept.  Concurrent requests of one drafter share its table.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from ..engine.drafting import Draft, DraftContext, Drafter, Session, TreeLayout, Verdict
from . import Method, register
from .knobs import Knobs, Most, boolean, brief, knob, positive_int
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


def resolve_tree(tree) -> StaticTree:
    if isinstance(tree, str):
        if tree not in TEMPLATES:
            raise ValueError(f"unknown tree template {brief(tree)}; available: {', '.join(TEMPLATES)} "
                             "(or give a list of choices such as [[0], [1], [0, 0]])")
        return tree_from_choices(TEMPLATES[tree])
    if isinstance(tree, StaticTree):
        return tree
    if not isinstance(tree, (list, tuple)) or not tree:
        raise ValueError(f"tree must be a template name or a non-empty list of choices, got {brief(tree)}")
    return tree_from_choices(tree)


def _parse_tree(text: str):
    return json.loads(text) if text.lstrip().startswith("[") else text


@dataclass(frozen=True)
class RecyclingKnobs(Knobs):
    method = "token-recycling"
    topk: int = knob(8, "Token Recycling: successors kept per token", most=Most(
        "min(vocabulary size, n_embd)", "no rank past the vocabulary exists, and the successor table (vocabulary x "
        "topk ids) then stays within the size of the model's embedding", lambda kn, s: min(s.vocab, s.n_embd)))
    tree: str | list | StaticTree = knob("2.2.2", "Token Recycling: draft tree template name or a JSON list of "
                                         "choices such as [[0],[1],[0,0]]", parse=_parse_tree, most=Most(
        "context nodes", "the whole tree is verified in one pass", lambda kn, s: s.context,
        measure=lambda tree: tree.size))
    reset: bool = knob(False, "Token Recycling: forget the successor table before this request")

    def validate(self, R: int) -> "RecyclingKnobs":
        positive_int(self, "topk")
        tree = resolve_tree(self.tree)
        if tree.max_rank >= self.topk:
            raise ValueError(f"tree uses successor rank {tree.max_rank} but topk is {self.topk}; "
                             f"raise topk to at least {tree.max_rank + 1}")
        boolean(self, "reset")
        return replace(self, tree=tree)


class RecyclingDrafter(Drafter):
    """Keeps the successor table across the requests it serves (the paper's hot start)."""

    name = "token-recycling"
    stateful = True
    width_knobs = ("tree",)

    def __init__(self, knobs: RecyclingKnobs):
        self.knobs = knobs
        self.width = knobs.tree.size
        self.table: SuccessorTable | None = None
        self._shapes: dict[tuple, tuple[TreeFiller, TreeLayout]] = {}

    def reset(self) -> None:
        """Forget the successor table (the next request starts cold)."""
        self.table = None

    def start(self, req: DraftContext) -> Session:
        V, device = req.config.vocab_size, req.device
        if self.knobs.topk > V:
            raise ValueError(f"topk {self.knobs.topk} exceeds the vocabulary size {V}")
        t = self.table
        if self.knobs.reset or t is None or t.table.shape[0] != V or t.table.device != device:
            self.table = SuccessorTable(V, self.knobs.topk, device)
        self.table.requests += 1
        return RecyclingSession(self, req)

    def shape(self, T: int, device: torch.device) -> tuple[TreeFiller, TreeLayout]:
        """The filler and layout of the template cut to its first T nodes (built once per T, shared)."""
        key = (T, device)
        shape = self._shapes.get(key)
        if shape is None:
            sub = self.knobs.tree.truncated(T)
            shape = self._shapes[key] = (TreeFiller(sub, device), TreeLayout(sub.parents, device=device))
        return shape


class RecyclingSession(Session):
    def propose(self) -> Draft:
        req, drafter = self.ctx, self.drafter
        # Nodes deeper than room - 1 could never be kept (the budget rule).
        T = drafter.knobs.tree.nodes_within_depth(req.room - 1)
        filler, layout = drafter.shape(T, req.device)
        nodes = req.draft_slots(T - 1)
        filler.fill(nodes, drafter.table.table)
        self.nodes = nodes.clone()            # the verifier rewrites the slots with the committed tokens
        return Draft(nodes[1:], layout=layout, in_place=True)

    def observe(self, verdict: Verdict) -> None:
        # The table is shared by the drafter's concurrent requests: a write only changes later drafts' acceptance.
        self.drafter.table.update(self.nodes, verdict.logits)


register(Method("token-recycling", RecyclingKnobs, RecyclingDrafter, stateful=True))
