"""The independent full-depth verifier (paper sec. 3.4) and acceptance, for chains and trees alike, over every
running request in one pass.

The target runs on each draft's input nodes [anchor, ...] with its own initial states and all R aligned steps;
its token at every node is the request's ``choose`` of its logits (the argmax when greedy).  A candidate path is
accepted node by node while each node's token equals the target's token at its parent; the longest accepted path
wins (the first, on ties).  Committed: the path's proposals, then the target's token after its last node when that
node was a verifier input (for a chain without bonus whose w proposals all matched, the last one is not, and
nothing follows it).  Only the path's rows keep their K/V: an index bump when the path is the first rows (every
chain), otherwise a compaction at every depth.  The last committed token is the next anchor.

The same pass carries the next prompt blocks of every request still being prefilled (``PrefillChunk``, one
segment per block), so a long prompt never stalls the requests that are decoding; a block the step budget gives
only some of its depths runs them in a call of its own (``prefill_slice``).  AR is a chain of no proposals.  By Proposition 1 the committed tokens
equal full-depth AR's, and since every request reads only its own cache, whatever else is in the pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ...model import decode_kernel
from ..base.contract import Phase
from ..base.request import Request, greedy
from ..drafting.batch import Batch
from ..drafting.draft import TreeLayout, Verdict


@dataclass
class Placed:
    """A draft placed after its request's anchor: the verifier's layout and how many of its nodes are inputs."""

    req: Request
    layout: TreeLayout
    inputs: int


@dataclass
class PrefillChunk:
    """Prompt rows [start, start + size) of a request being prefilled (one block, or the prompt's last part);
    ``last``: it ends the prompt, so its last row's logits choose the first token."""

    req: Request
    start: int
    size: int
    last: bool = False
    depths: tuple[int, int] | None = None     # a depth slice: core steps (r0, r1] only (``prefill_slice``)


def prefill_slice(c: PrefillChunk) -> Tensor | None:
    """Core steps (r0, r1] of one prompt block, in a call of its own: the prelude first when r0 = 0, the readout
    (coda K/V; the first token's logits [1, V] when the block ends the prompt) when r1 = R.  The state between
    slices stays on the request (``Request.depth_slice``).  Each core step r reads the prefix at depth r, which was
    complete before the block began, so the rows equal the whole block's.  Returns the logits when it ends the
    prompt at full depth, else None."""
    req, (r0, r1) = c.req, c.depths
    if req.exit is not None:
        raise ValueError("a prompt block under an exit rule runs whole (the rule reads every step's state)")
    b = Batch([req], [c.start], [c.size])
    if r0 == 0:
        inj = b.prelude(b.ids())
        h = b.start_state(b.initial(), inj)
    else:
        if req.depth_slice is None or req.depth_slice[0] != r0:
            have = None if req.depth_slice is None else req.depth_slice[0]
            raise RuntimeError(f"request {req.rid}: a depth slice planned from core step {r0}, but {have} are done")
        _, h, inj = req.depth_slice
    for r in range(r0 + 1, r1 + 1):
        h = b.core_step(h, inj, read=(r, r))
    req.counts.count(Phase.PREFILL, r1 - r0, (r1 - r0) * c.size)
    if r1 < req.R:
        req.depth_slice = (r1, h.clone(), inj.clone())    # kept across steps: not in a compiled call's output pool
        return None
    req.depth_slice = None
    rows = torch.tensor([c.size - 1] if c.last else [], dtype=torch.long, device=req.device)
    logits = b.readout(h, rows)[0]
    return logits if c.last else None


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


def verify_step(drafts: list[Placed], prefills: list[PrefillChunk] = ()) -> tuple[list[Verdict], list[Tensor]]:
    """One full-depth pass over every draft (and prefill chunk); commits each draft's accepted path and returns
    its ``Verdict`` (in order), and the last row's logits [1, V] of every prefill chunk that ends its prompt."""
    if not drafts and not prefills:         # every request of the step stopped while drafting: no pass
        return [], []
    reqs, starts, widths, positions, masks = [], [], [], [], []
    for d in drafts:
        req, layout, n = d.req, d.layout, d.req.n
        reqs.append(req), starts.append(n), widths.append(d.inputs)
        if layout.is_chain:
            positions.append(None), masks.append(None)
        else:
            mask = torch.ones(d.inputs, n + d.inputs, dtype=torch.bool, device=req.device)
            mask[:, n:] = layout.mask
            positions.append(n + layout.depth), masks.append(mask)
        req.counts.count(Phase.VERIFY, req.R, req.R * d.inputs)
    for c in prefills:
        reqs.append(c.req), starts.append(c.start), widths.append(c.size)
        positions.append(None), masks.append(None)
        c.req.counts.count(Phase.PREFILL, c.req.R, c.req.R * c.size)
    batch = Batch(reqs, starts, widths, positions, masks)
    # logits of every draft row, and of the last row of a prompt whose prefill ends here (the head is not free)
    if prefills:
        keep = [torch.arange(batch.offsets[i], batch.offsets[i + 1]) for i in range(len(drafts))]
        keep += [torch.tensor([batch.offsets[len(drafts) + j + 1] - 1]) for j, c in enumerate(prefills) if c.last]
        rows = torch.cat(keep) if keep else torch.zeros(0, dtype=torch.long)
        logits = batch.full_depth(reqs[0].R, rows.to(reqs[0].device))     # K/V of every row, logits of ``rows``
        parts = list(torch.split(logits, [d.inputs for d in drafts] + [1 for c in prefills if c.last]))
    else:
        logits = batch.full_depth(reqs[0].R)
        parts = batch.split(logits)
    return accept_all(drafts, parts[: len(drafts)], logits), parts[len(drafts):]


def accept_all(drafts: list[Placed], logits: list[Tensor], whole: Tensor | None = None) -> list[Verdict]:
    """Acceptance of each draft against its target logits; one device -> host transfer for the whole batch.
    ``whole``: the tensor ``logits`` were split from, draft after draft from its first row (its greedy argmax is
    taken at once, without copying the parts together)."""
    if not drafts:
        return []
    greedy_all = all(d.req.choose is greedy for d in drafts)
    if greedy_all and len(drafts) > 1:
        sizes = [d.inputs for d in drafts]
        z = whole[: sum(sizes)] if whole is not None else torch.cat(logits)
        top = decode_kernel.argmax(z)
        preds = list(torch.split(top, sizes))
    else:
        top = None
        preds = [d.req.choose(z, d.req.n if d.layout.is_chain else d.req.n + d.layout.depth)
                 for d, z in zip(drafts, logits)]
    if all(d.layout.size == 1 for d in drafts):       # AR steps (anchors alone): nothing to accept
        ids = (top if top is not None else torch.cat(preds)).tolist()
        # ``commit``'s host for a lone anchor: none accepted, path [0], the anchor's token (not read), the target's
        return [commit(d, [0, 0, 0, t], pred, z) for d, t, pred, z in zip(drafts, ids, preds, logits)]
    host_parts, sizes = [], []
    for d, pred in zip(drafts, preds):
        n, layout = d.req.n, d.layout
        nodes = d.req.tokens[n: n + layout.size]
        acc, best = accept(nodes, pred, layout.paths)
        row = layout.paths[best]
        safe = row.clamp(min=0)
        pred_row = pred[safe.clamp(max=d.inputs - 1)]
        host_parts.append(torch.cat((acc.view(1), row, nodes[safe], pred_row)))
        sizes.append(1 + 3 * row.numel())
    flat = (host_parts[0] if len(host_parts) == 1 else torch.cat(host_parts)).tolist()   # one transfer
    verdicts, o = [], 0
    for d, pred, z, size in zip(drafts, preds, logits, sizes):
        verdicts.append(commit(d, flat[o: o + size], pred, z))
        o += size
    return verdicts


def commit(d: Placed, host: list[int], pred: Tensor, logits: Tensor) -> Verdict:
    """Commit one draft's accepted path: host = [a | path (D) | its tokens (D) | target tokens (D)]."""
    req, layout, inputs = d.req, d.layout, d.inputs
    n = req.n
    D = (len(host) - 1) // 3
    a = host[0]
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
        req.cache.compact(n + torch.tensor(path, dtype=torch.long, device=req.device))
        req.tokens[n + 1: n + 1 + len(chunk)] = torch.tensor(chunk, dtype=torch.long, device=req.device)
    req.generated.extend(chunk)               # the scheduler applies the stop rule
    return Verdict(len(chunk), a, path, chunk, pred, logits)
