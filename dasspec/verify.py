"""The independent full-depth verifier (paper sec. 3.4) and greedy acceptance.

``verify_chain`` consumes the anchor x_t and proposals y_1..y_w, runs the target on [x_t, y_1, ..., y_{w-1}] with
its own initial states and all R aligned steps, and reads target predictions p_1..p_w (p_w verifies y_w although
y_w is not an input).  Proposals are accepted in order until the first mismatch, where the target's token is
emitted instead; when all w match there is no further conditional, so no bonus token.  Only the anchor and the
accepted inputs keep their K/V (an index bump); the last emitted token becomes the next anchor.

AR is ``verify_chain`` with no proposals.  By Proposition 1 the committed tokens equal full-depth AR's.
"""

from __future__ import annotations

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
    dec.stats.verify_passes += dec.R
    dec.stats.verify_updates += dec.R * win
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
    dec.stats.proposed.append(w)
    dec.stats.accepted.append(min(a, kept))
    dec.stats.target_tokens.append(int(target_token and kept == len(chunk)))
    return kept
