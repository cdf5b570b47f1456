"""What a drafter hands the verifier, what it gets back, and the contract between drafters and the engine.

A *draft* extends the anchor (node 0, the last committed token) with proposal nodes 1..: a chain, or a tree given
by a ``TreeLayout``.  The engine places its tokens in the request's scratch slots after the anchor (checking they
fit), the full-depth target verifies it (``verify.py``) and returns a ``Verdict`` that the drafter may learn from.

A *drafter* holds a method's knobs and what it keeps across requests (Token Recycling's successor table, SAM's
corpus automaton); ``start(ctx)`` gives a *session*, the state of one request (its text index, carried states,
n-gram pool), holding the request's read-only ``DraftContext`` (``context.py``).  Each engine step asks every drafter for the drafts of all its running sessions at once
(``propose_batch``: drafters that read the model batch those passes across requests), verifies them all in one
pass, and tells each session its verdict (``Session.observe``).  Sessions of one drafter run concurrently, so
what they share must stay valid whatever the others do (it only ever changes how much is accepted, never a token).

The contract, enforced by ``DraftContext``: a session may read of its request ``n`` (the anchor's position = the
verified rows), ``P`` and ``prompt``, ``generated`` (committed tokens, the anchor last), ``R``, ``room``, ``cap``,
``config``, ``device``, ``choose`` (the request's token choice: greedy or its seeded sampler), ``stopping()``; it
may write proposals into ``scratch(w)`` and run the model only through ``dasspec.engine.drafting.batch`` over contexts (the
three primitives on the scratch rows past ``n``, counted with ``count``).  Nothing else of the request.

The budget rule, stated once: a verifier input at depth D below the anchor yields the target's token for depth
D + 1, and only ``req.room`` more tokens may be committed, so every node that can be committed - on a candidate
path - lies at depth <= room - 1.  A chain of w proposals has inputs at depths 0..w-1 (w <= room), or 0..w with
``bonus`` (w <= room - 1); a tree's candidates are its ``paths``.  Nodes off every candidate path (Lookahead's
window) need only a position inside the context: depth <= ``req.depth_limit``.  ``place`` cuts a chain to the rule
and refuses a tree that breaks it.  ``width``: the most verifier inputs any draft of the drafter needs (the
request's scratch rows are sized from it).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import torch
from torch import Tensor

if TYPE_CHECKING:
    from .context import DraftContext
    from ..base.contract import PassTiming


class TreeLayout:
    """Topology of a draft tree in verifier input order: node 0 is the root (the anchor), every node's parent
    comes before it.  Built once per shape and reused every step:

    * ``depth``  [T]      node depth; the node sits at position n + depth (siblings share a position);
    * ``mask``   [T, T]   ancestor-or-self visibility among the nodes (the prefix is always visible);
    * ``paths``  [L, D+1] candidate root-to-node index paths, padded with -1 - by default every root-to-leaf
                          path; ``leaves`` restricts them (Lookahead's Jacobi window rides along in the same
                          pass but is never a candidate).

    A chain (parent i-1 for every node, all of it a candidate) is flagged ``is_chain``: it verifies as a plain
    causal block, with no mask and no gather when committing."""

    def __init__(self, parents: Sequence[int], leaves: Sequence[int] | None = None,
                 device: torch.device | str | None = None):
        parents = [int(p) for p in parents]
        T = len(parents)
        if T == 0 or parents[0] != -1:
            raise ValueError("a draft tree needs a root: parents[0] must be -1")
        for i, p in enumerate(parents[1:], 1):
            if not 0 <= p < i:
                raise ValueError(f"node {i} has parent {p}; parents must come before their children")
        path_of: list[list[int]] = [[0]]
        for i in range(1, T):
            path_of.append(path_of[parents[i]] + [i])
        if leaves is None:
            has_child = set(parents[1:])
            leaves = [i for i in range(T) if i not in has_child]
        leaves = [int(i) for i in leaves]
        rows = [i for i in range(T) for _ in path_of[i]]
        cols = [j for i in range(T) for j in path_of[i]]
        mask = torch.zeros(T, T, dtype=torch.bool)
        mask[rows, cols] = True
        chosen = [path_of[i] for i in leaves] or [[0]]
        width = max(len(p) for p in chosen)
        self.parents = tuple(parents)
        self.size = T
        self.depth = torch.tensor([len(p) - 1 for p in path_of], dtype=torch.long, device=device)
        self.mask = mask.to(device)
        self.paths = torch.tensor([p + [-1] * (width - len(p)) for p in chosen], dtype=torch.long, device=device)
        self.is_chain = parents == list(range(-1, T - 1)) and leaves == [T - 1]
        self.max_depth = max(len(p) for p in path_of) - 1     # the deepest node
        self.candidate_depth = width - 1                       # the deepest node on a candidate path
        self.proposals = len({j for p in chosen for j in p}) - 1     # candidate nodes besides the root

    @classmethod
    def chain(cls, T: int, device: torch.device | str | None = None) -> "TreeLayout":
        """The anchor followed by T-1 proposals in a row (built once per shape and device, then shared)."""
        return _shared_layout(tuple(range(-1, T - 1)), _device_key(device))

    @classmethod
    def fork(cls, a: int, shared: int, b: int, device: torch.device | str | None = None) -> "TreeLayout":
        """Two chains from the anchor that share their first ``shared`` proposals: nodes 1..a in a row, then b
        nodes in a row continuing from node ``shared`` (0 = the anchor).  Built once per shape and device."""
        if not 0 <= shared <= a:
            raise ValueError(f"the shared prefix ({shared}) must lie within the first chain (a = {a})")
        parents = tuple(range(-1, a)) + ((shared,) + tuple(range(a + 1, a + b)) if b else ())
        return _shared_layout(parents, _device_key(device))


def _device_key(device: torch.device | str | None) -> torch.device | None:
    return None if device is None else torch.device(device)


@functools.lru_cache(maxsize=1024)
def _shared_layout(parents: tuple[int, ...], device: torch.device | None) -> TreeLayout:
    # Layouts are read-only after construction, so every decoder (and every request) can share one per shape.
    return TreeLayout(parents, device=device)


@dataclass
class Draft:
    """Proposals after the anchor: ``tokens`` are nodes 1, 2, ... (a device tensor, a numpy array or a list; a
    view of ``req.scratch(w)`` is used in place).

    ``in_place``: the tokens are already in the request's scratch slots (``ctx.scratch`` / ``draft_slots``).

    A chain (``layout`` None) is verified as the paper's block [anchor, y_1 .. y_{w-1}], which tests y_1 .. y_w: when
    all w match there is no further conditional, so no bonus token.  ``bonus=True`` feeds y_w too (w + 1 positions),
    so a fully accepted chain also commits the target's next token.  A tree (``layout`` given, its node 0 the
    anchor) feeds every node and always commits the target's token after the accepted path.  ``notes``: what the
    drafter wants a trace to show about this block."""

    tokens: Tensor | np.ndarray | Sequence[int] = ()
    layout: TreeLayout | None = None
    bonus: bool = False
    notes: dict[str, Any] | None = None
    in_place: bool = False


@dataclass
class Verdict:
    """The target's answer to one draft."""

    kept: int                 # tokens committed, after the stop rule
    accepted: int             # proposals accepted on the best path
    path: list[int]           # committed node indices, the anchor first (accepted + 1 of them)
    tokens: list[int]         # the committed chunk before the stop rule: accepted proposals + the target's token
    pred: Tensor              # [inputs] the target's token at every verifier input node
    logits: Tensor            # [inputs, V] float32 target logits (drafters learn from them)


class Session:
    """One request's drafting state.  The base proposes nothing: every block is one full-depth AR step."""

    def __init__(self, drafter: "Drafter", ctx: "DraftContext"):
        self.drafter, self.ctx = drafter, ctx

    def propose(self) -> Draft:
        return Draft()

    def observe(self, verdict: Verdict) -> None:
        """The verifier's answer to the last draft (already committed)."""


class Drafter:
    """A method's drafter: knobs and cross-request state; ``start`` makes a request's ``Session``.  Subclasses set
    ``session`` (the class ``start`` instantiates) and override ``propose_batch`` to batch model passes."""

    name = "ar"
    width = 1                 # verifier inputs the engine always backs for a draft of this drafter
    reach: int | None = None  # longest chain it may propose, when longer than ``width`` (backed when memory allows;
                              # otherwise the chain is cut to the rows backed this step, as to ``room``)
    width_knobs: tuple[str, ...] = ()     # the knobs that set ``width`` (named when it cannot fit a context)
    stateful = False          # keeps state across requests (benchmarks then bootstrap over blocks of requests)
    session: type[Session] = Session

    def start(self, ctx: "DraftContext") -> Session:
        """A new request has been prefilled (its first token emitted): its drafting session."""
        return self.session(self, ctx)

    def propose_batch(self, sessions: "list[Session]") -> list[Draft]:
        """The drafts of every running session of this drafter, in order (one engine step)."""
        return [s.propose() for s in sessions]

    def recall(self, model, R: int, call: tuple) -> None:
        """Built by a ``generate`` / ``generate_batch`` call for itself: a drafter that starts from what the last such
        call measured on ``model`` (auto) takes it now.  ``call``: what the call decides besides the drafter."""

    def remember(self) -> None:
        """That call has ended: keep what was measured for the next one (after ``recall``)."""

    def measured(self, timing: "PassTiming") -> None:
        """What the executor measured of the step's verification pass that held this drafter's drafts (after the
        sessions observed their verdicts).  Drafters that price their choices (method auto) learn from it."""
