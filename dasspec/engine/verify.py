"""The independent full-depth verifier (paper sec. 3.4) and acceptance, for chains and trees alike.

The target runs on the draft's input nodes [anchor, ...] with its own initial states and all R aligned steps
(``Request.target_pass``); its token at every node is ``req.choose`` of its logits (the argmax when greedy).  A
candidate path is accepted node by node while each node's token equals the target's token at its parent; the
longest accepted path wins (the first, on ties).  Committed: the path's proposals, then the target's token after
its last node when that node was a verifier input (for a chain without bonus whose w proposals all matched, the
last one is not, and nothing follows it).  Only the path's rows keep their K/V: an index bump when the path is the
first rows (every chain), otherwise a compaction at every depth.  The last committed token is the next anchor.

AR is a chain of no proposals.  By Proposition 1 the committed tokens equal full-depth AR's.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .draft import TreeLayout, Verdict
from .request import Request


def accept(tree_tokens: Tensor, pred: Tensor, paths: Tensor) -> tuple[Tensor, Tensor]:
    """Acceptance over candidate paths, on the device: a path's node j+1 is accepted while its token equals the
    target's token at node j.  ``pred`` may be shorter than the tree (a node without an input has no prediction;
    only a chain's last node, never a parent).  Returns (accepted count of the best path, its row); the first
    longest path wins.  Padding (-1) never matches."""
    nxt = paths[:, 1:]
    cand = torch.where(nxt >= 0, tree_tokens[nxt.clamp(min=0)], -1)
    ok = (cand == pred[paths[:, :-1].clamp(min=0)]).long().cumprod(dim=1)
    acc = ok.sum(dim=1)
    best = acc.argmax()                     # first maximum
    return acc[best], best


def verify(req: Request, layout: TreeLayout, inputs: int) -> Verdict:
    """Verify the draft whose nodes are in ``req.tokens[n : n + layout.size]`` (node 0 = the anchor, already
    there); the first ``inputs`` nodes are fed to the target.  Commits and applies the stop rule."""
    n = req.n
    nodes = req.tokens[n: n + layout.size]
    with req.timer("verify"):
        if layout.is_chain:
            logits = req.target_pass(n, inputs)
            pred = req.choose(logits, n)
        else:
            mask = torch.ones(inputs, n + inputs, dtype=torch.bool, device=nodes.device)
            mask[:, n:] = layout.mask
            positions = n + layout.depth
            logits = req.target_pass(n, inputs, positions=positions, mask=mask)
            pred = req.choose(logits, positions)
        acc, best = accept(nodes, pred, layout.paths)
        row = layout.paths[best]
        safe = row.clamp(min=0)
        D = row.numel()
        pred_row = pred[safe.clamp(max=inputs - 1)]
        host = torch.cat((acc.view(1), row, nodes[safe], pred_row)).tolist()   # one device->host transfer
        a = host[0]                             # host = [a | path (D) | its tokens (D) | target tokens (D)]
        path = host[1: 2 + a]
        chunk = host[2 + D: 2 + D + a]          # the accepted proposals
        target = path[-1] < inputs              # the path's last node was an input: the target's token follows
        if target:
            chunk.append(host[1 + 2 * D + a])
        if layout.is_chain or path == list(range(a + 1)):     # the path is the first rows: an index bump
            req.cache.commit(a + 1 if target else a)
            if target:
                req.tokens[n + 1 + a] = chunk[-1]
        else:                                                  # a tree path elsewhere: move its rows into place
            req.cache.compact(n + torch.tensor(path, dtype=torch.long, device=nodes.device))
            req.tokens[n + 1: n + 1 + len(chunk)] = torch.tensor(chunk, dtype=torch.long, device=nodes.device)
    kept = req.emit(chunk)
    req.stats.record(layout.proposals, min(a, kept), target and kept == len(chunk))
    return Verdict(kept, a, path, chunk, pred, logits)
