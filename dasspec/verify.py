"""The independent full-depth verifier (paper sec. 3.4) and greedy acceptance.

``verify_chain`` consumes the anchor x_t and proposals y_1..y_w, runs the target on [x_t, y_1, ..., y_{w-1}] with
its own initial states and all R aligned steps, and reads target predictions p_1..p_w (p_w verifies y_w although
y_w is not an input).  Proposals are accepted in order until the first mismatch, where the target's token is
emitted instead; when all w match there is no further conditional, so no bonus token.  Only the anchor and the
accepted inputs keep their K/V (an index bump); the last emitted token becomes the next anchor.

AR is ``verify_chain`` with no proposals.  By Proposition 1 the committed tokens equal full-depth AR's.

``verify_tree`` verifies a draft tree (or a chain that wants the bonus token) in one pass with a tree attention
mask and per-node positions, and compacts the accepted path's K/V into place at every depth (model-agnostic
baselines in ``dasspec.drafters``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from .decoding import Decoding


def verify_chain(dec: Decoding, proposals: Tensor | list[int] | None = None) -> int:
    """Verify a chain of proposals (1-D, may be empty) and commit; returns the number of tokens kept."""
    n = dec.n
    if proposals is None:
        w = 0
    else:
        proposals = torch.as_tensor(proposals, dtype=torch.long, device=dec.tokens.device).reshape(-1)
        w = min(int(proposals.numel()), dec.budget)   # never test more than the cap can keep
        if w:
            dec.tokens[n + 1: n + 1 + w] = proposals[:w]
    win = max(w, 1)
    with dec.timer("verify"):
        logits = dec.target_pass(n, win)
        pred = logits.argmax(-1)
        host = torch.cat((pred, dec.tokens[n + 1: n + 1 + w])).tolist()   # one device->host transfer
    pred_h, prop_h = host[:win], host[win:]
    a = 0
    while a < w and prop_h[a] == pred_h[a]:
        a += 1
    chunk = prop_h[:a]
    target_token = a < w or w == 0
    if target_token:
        chunk.append(pred_h[a])
        dec.tokens[n + 1 + a] = pred_h[a]
    dec.cache.commit(min(a + 1, win))
    kept = dec.emit(chunk)
    dec.stats.record(w, min(a, kept), target_token and kept == len(chunk))
    return kept


# ---------------------------------------------------------------------------------------------------------------
# Tree verification (Token Recycling, Lookahead's candidate forest, SAM's static-corpus trees, chain drafts + bonus)
# ---------------------------------------------------------------------------------------------------------------

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


def greedy_accept(tree_tokens: Tensor, pred: Tensor, paths: Tensor) -> tuple[Tensor, Tensor]:
    """Greedy acceptance over candidate paths, on the device: a path's node j+1 is accepted while it equals the
    target's prediction at node j.  Returns (accepted count of the best path, its row); the first longest path
    wins.  Padding (-1) never matches."""
    nxt = paths[:, 1:]
    cand = torch.where(nxt >= 0, tree_tokens[nxt.clamp(min=0)], -1)
    ok = (cand == pred[paths[:, :-1].clamp(min=0)]).long().cumprod(dim=1)
    acc = ok.sum(dim=1)
    best = acc.argmax()                     # first maximum
    return acc[best], best


@dataclass
class TreeVerdict:
    kept: int            # tokens committed (accepted proposals + the target's token), after the stop rule
    accepted: int        # accepted proposals on the best path
    path: list[int]      # node indices committed, root included (length accepted + 1)
    logits: Tensor       # [T, V] float32 target logits at every node (drafters learn from them)
    pred: Tensor         # [T] target argmax at every node


def verify_tree(dec: Decoding, layout: TreeLayout) -> TreeVerdict:
    """Verify the draft tree whose tokens are in ``dec.tokens[n : n + T]`` (node 0 = the anchor, already there)
    in one full-depth pass: per-node positions n + depth, ancestor-or-self mask over the verified prefix.  Accepts
    the longest matching root-to-node path, emits its proposals plus the target's token after its last node (a
    tree always has that conditional, so there is always a correction/bonus token), commits the path's K/V
    (``cache.compact``; an index bump when the path is the first T rows) and applies the stop rule."""
    n, T = dec.n, layout.size
    toks = dec.tokens[n: n + T]
    with dec.timer("verify"):
        if layout.is_chain:
            logits = dec.target_pass(n, T)
        else:
            mask = torch.ones(T, n + T, dtype=torch.bool, device=toks.device)
            mask[:, n:] = layout.mask
            logits = dec.target_pass(n, T, positions=n + layout.depth, mask=mask)
        pred = logits.argmax(-1)
        acc, best = greedy_accept(toks, pred, layout.paths)
        row = layout.paths[best]
        safe = row.clamp(min=0)
        host = torch.cat((acc.view(1), row, toks[safe], pred[safe])).tolist()   # one device->host transfer
        D = row.numel()                     # host = [a | path row (D) | its tokens (D) | its predictions (D)]
        a = host[0]
        path = host[1: 2 + a]
        chunk = host[2 + D: 2 + D + a] + [host[1 + 2 * D + a]]   # accepted proposals + the target's token
        if path == list(range(a + 1)):
            dec.cache.commit(a + 1)
        else:
            dec.cache.compact(n + torch.tensor(path, dtype=torch.long, device=toks.device))
        dec.tokens[n + 1: n + 2 + a] = torch.tensor(chunk, dtype=torch.long, device=toks.device)
    kept = dec.emit(chunk)
    dec.stats.record(layout.proposals, min(a, kept), kept == len(chunk))
    return TreeVerdict(kept, a, path, logits, pred)
