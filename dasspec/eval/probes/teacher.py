"""Teacher forcing on the target's own trajectory: one full-depth pass materialises K/V at every recurrence depth for
every position, then a shallow draft is evaluated at every position at once (the channel and grid probes).

The draft for position t is what a sequential drafter computes when t is the anchor and rows [0, t) are the
verified prefix (paper sec. 3.2, Appendix C.1): d core steps from t's own initial state, step j reading the prefix
keys at depth kappa_j and values at nu_j, and t's own K/V from step j of its own computation.  All positions run
together as one span: queries sit in scratch rows [T, T+W) with RoPE of their real positions, and the mask lets
query t see prefix rows j < t and its own scratch row only.

The coda has no depth index: by default (``coda="target"``) the draft reads the prefix's full-depth coda K/V, which
is what the decoders do.  ``coda="aligned"`` reads coda K/V computed from the prefix's synchronous depth-d states
instead, so that the Aligned draft is exactly a plain depth-d forward (``model(ids, num_steps=d)``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...model.cache import DepthCache
from ...model.looped import LoopedLM
from ...model.policy import ReadPolicy, parse_policy

CODAS = ("target", "aligned")


class TeacherForced:
    """The full-depth target on a fixed token sequence [T], with every depth's prefix K/V kept.

    ``target`` [T] is the target's argmax at each position; ``draft_logits`` evaluates a depth-d draft under a read
    policy at chosen positions."""

    def __init__(self, model: LoopedLM, tokens: Tensor, num_steps: int | None = None, init_scale: float = 1.0,
                 seed: int = 0, chunk: int = 128):
        cfg = model.config
        self.model = model
        self.R = model.depth(num_steps)
        self.tokens = tokens.to(model.device).reshape(-1)
        T = self.T = int(self.tokens.numel())
        if T < 1:
            raise ValueError("empty sequence")
        # Draft queries need scratch rows after the T prefix rows; they go in chunks of C so T + C fits the context.
        self.C = min(chunk, T, cfg.block_size - T)
        if self.C < 1:
            raise ValueError(f"sequence of {T} tokens leaves no room for draft rows in the model context "
                             f"({cfg.block_size}); use fewer prompt or new tokens")
        self.cache = DepthCache(cfg, self.R, T + self.C, model.device, model.dtype)
        self.h0 = model.initial_state(torch.arange(T, device=model.device), init_scale, seed).unsqueeze(0)
        self.span0 = model.span(0, 0, T)
        with torch.inference_mode():
            inj = model.prelude(self.tokens.unsqueeze(0), self.span0, self.cache)
            h = model.start_state(self.h0, inj)
            # The synchronous state after each depth (for the depth-d coda of coda="aligned").
            self.states = torch.empty(self.R, T, cfg.n_embd, device=model.device, dtype=model.dtype)
            for r in range(1, self.R + 1):
                h = model.recur(h, inj, self.span0, self.cache, range(r, r + 1))
                self.states[r - 1] = h[0]
            self.logits = model.readout(h, self.span0, self.cache)[0]
        self.cache.commit(T)
        self.target = self.logits.argmax(-1)
        self._coda: dict[int, DepthCache] = {self.R: self.cache}
        pos = torch.arange(T, device=model.device)
        self._visible = pos[None, :] < pos[:, None]              # [T, T] query t sees prefix rows j < t

    def _coda_cache(self, d: int, coda: str) -> DepthCache:
        """Where the draft's readout finds prefix coda K/V: the target's (full depth) or a depth-d pass's."""
        if coda == "target":
            return self.cache
        if coda != "aligned":
            raise ValueError(f"coda must be one of {CODAS}, got {coda!r}")
        cache = self._coda.get(d)
        if cache is None:
            m = self.model
            cache = DepthCache(m.config, 1, self.T + self.C, m.device, m.dtype)
            with torch.inference_mode():
                m.readout(self.states[d - 1].unsqueeze(0), self.span0, cache)
            self._coda[d] = cache
        return cache

    def draft_logits(self, d: int, policy: "str | ReadPolicy | tuple", rows: range | None = None,
                     coda: str = "target") -> Tensor:
        """Float32 logits [len(rows), V] of the depth-d draft at positions ``rows`` (default: all), position t
        predicting token t+1 from the verified prefix [0, t) read under ``policy``."""
        model, cache, R, T = self.model, self.cache, self.R, self.T
        if not 1 <= d <= R:
            raise ValueError(f"draft depth {d} outside 1..R={R}")
        policy = parse_policy(policy)
        reads = [policy.depths(j, R) for j in range(1, d + 1)]
        rows = range(T) if rows is None else rows
        if rows.step != 1 or (len(rows) and not (0 <= rows.start and rows.stop <= T)):
            raise ValueError(f"rows must be a contiguous range inside [0, {T}), got {rows}")
        coda_cache = self._coda_cache(d, coda)
        out = torch.empty(len(rows), model.config.vocab_size, device=model.device)
        eye = torch.eye(self.C, dtype=torch.bool, device=model.device)
        with torch.inference_mode():
            for a in range(rows.start, rows.stop, self.C):
                b = min(a + self.C, rows.stop)
                W = b - a
                mask = torch.cat((self._visible[a:b], eye[:W, :W]), dim=1)          # [W, T + W]
                span = model.span(T, T, W, positions=torch.arange(a, b, device=model.device), mask=mask)
                inj = model.prelude(self.tokens[a:b].unsqueeze(0), span, cache)
                h = model.start_state(self.h0[:, a:b], inj)
                for j, read in enumerate(reads, 1):
                    h = model.core_step(h, inj, span, cache, read=read, own=(j, j))
                out[a - rows.start: b - rows.start] = model.readout(h, span, coda_cache)[0]
        return out

    def agreement(self, d: int, policy: "str | ReadPolicy | tuple", rows: range,
                  coda: str = "target") -> tuple[int, int]:
        """(positions where the draft's argmax equals the target's, positions evaluated)."""
        if len(rows) == 0:
            return 0, 0
        pred = self.draft_logits(d, policy, rows, coda).argmax(-1)
        return int((pred == self.target[rows.start: rows.stop]).sum()), len(rows)


def scored_rows(prompt_len: int, total: int) -> range:
    """Positions a drafter predicts from along a trajectory of ``total`` tokens (prompt + N generated): the
    anchors P .. P+N-2, each predicting the next generated token (N-1 positions; the first generated token comes
    from prefill and is never drafted).  The teacher-forced inputs are tokens[:total-1]."""
    return range(prompt_len, total - 1)
