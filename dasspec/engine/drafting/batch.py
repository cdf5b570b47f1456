"""The model's three primitives over several requests in one call - how the engine verifies every running request
in one pass, and how drafters that read the model batch their passes.

    b = Batch(reqs, starts, widths)                # request i's rows [starts[i], starts[i] + widths[i])
    e = b.prelude(b.ids())                         # [1, T, d]: every request's rows end to end
    h = b.core_step(b.initial(), e, read=(R, R), own=(j, j))
    logits = b.readout(h)                          # float32 [1, T', V]
    per_request = b.split(logits[0])

Each request reads and writes only its own cache (its blocks of the engine's pool) and sees only its own verified
prefix, so a row's value does not depend on what else is in the batch; the linear layers run once over all T rows
(``attention.RaggedSpan``) and attention runs per segment.  A request may appear more than once (consecutive prompt
blocks prefilled as segments of one pass).  A batch of one is the request's own call (on a CPU, a ragged call of one
segment, which takes the one-call kernels: the same bits).  Drafters build
batches over their ``DraftContext``s; the engine over its requests.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from ...model import decode_kernel
from ...model.attention import RaggedSpan, Span
from ...model.cache import BatchCache, PagedCache
from ..base.request import Request
from .context import DraftContext


def _one_call(span: Span, cache) -> bool:
    """Whether a request alone is called as a batch of one: in float32 on a CPU with the kernels built, in the
    engine's pool and without static rows, a batch's layers run in one kernel call per step (``attention.row_plan``,
    the families' ``recur_rows``) where a lone span runs each layer from Python; the same kernels, so the same
    bits.  Elsewhere no one-call kernel runs, and a lone span skips the batch's checks."""
    if not isinstance(cache, PagedCache) or span.rows is not None:
        return False
    k = cache.pool.core_k
    return k.device.type == "cpu" and k.dtype == torch.float32 and decode_kernel.available()


class Batch:
    def __init__(self, reqs: Sequence[Request | DraftContext], starts: Sequence[int], widths: Sequence[int],
                 positions: Sequence[Tensor | None] | None = None, masks: Sequence[Tensor | None] | None = None):
        reqs = [r._req if isinstance(r, DraftContext) else r for r in reqs]
        self.reqs, self.starts, self.widths = list(reqs), list(starts), list(widths)
        self.positions = list(positions) if positions is not None else [None] * len(self.reqs)
        masks = list(masks) if masks is not None else [None] * len(self.reqs)
        spans = [r.span(s, w, positions=p, mask=m)
                 for r, s, w, p, m in zip(self.reqs, self.starts, self.widths, self.positions, masks)]
        self.net = self.reqs[0].net
        if len(self.reqs) == 1 and not _one_call(spans[0], self.reqs[0].cache):
            self.span: Span | RaggedSpan = spans[0]
            self.cache = self.reqs[0].cache
        else:
            self.cache = BatchCache([r.cache for r in self.reqs])
            self.span = RaggedSpan.of(spans)
        self.offsets = [0]
        for w in self.widths:
            self.offsets.append(self.offsets[-1] + w)

    @property
    def T(self) -> int:
        return self.offsets[-1]

    def _cat(self, parts: list[Tensor], dim: int = 1) -> Tensor:
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)

    def ids(self) -> Tensor:
        """The rows' tokens [1, T] (each request's token slots)."""
        return self._cat([r.tokens[s: s + w] for r, s, w in zip(self.reqs, self.starts, self.widths)], 0)[None]

    def initial(self) -> Tensor:
        """The target's initial states of the rows [1, T, d]."""
        return self._cat([r.initial(s, w, p) for r, s, w, p in zip(self.reqs, self.starts, self.widths,
                                                                    self.positions)])

    def split(self, x: Tensor, dim: int = 0) -> list[Tensor]:
        """``x`` cut into the requests' parts along ``dim`` (rows in batch order)."""
        if len(self.reqs) == 1:
            return [x]
        return list(torch.split(x, self.widths, dim=dim))

    # --- the three primitives ----------------------------------------------------------------------------
    def prelude(self, ids: Tensor) -> Tensor:
        return self.net.prelude(ids, self.span, self.cache)

    def core_step(self, h: Tensor, inj: Tensor, read: tuple[int, int], own: tuple[int, int] | None = None) -> Tensor:
        return self.net.core_step(h, inj, self.span, self.cache, read=read, own=own)

    def recur(self, h: Tensor, inj: Tensor, depths: range, reads: list[tuple[int, int]] | None = None) -> Tensor:
        """Core steps ``depths``, each storing at its own depth and reading the prefix there (aligned, as the target
        runs them) or at ``reads``' depths (kappa, nu), one pair per step: a draft's reads (``LoopedLM.recur``)."""
        return self.net.recur(h, inj, self.span, self.cache, depths, reads)

    def readout(self, h: Tensor, rows: slice | Tensor | None = None) -> Tensor:
        return self.net.readout(h, self.span, self.cache, rows=rows)

    def start_state(self, h0: Tensor, inj: Tensor) -> Tensor:
        """What the first core step reads (the model's hook: h0, or the prelude output for Ouro)."""
        return self.net.start_state(h0, inj)

    def full_depth(self, R: int, rows: slice | Tensor | None = None) -> Tensor:
        """The target on every row: prelude, R aligned core steps from the target's initial states, readout ->
        float32 logits [T', V] (``rows`` of the T), each request's rows read out from the step its exit rule picks
        (``Request.exit``; None: the last)."""
        exits = [r.exit for r in self.reqs]
        if all(x is None for x in exits) or all(x == exits[0] for x in exits):
            return self.net.full_depth(self.ids(), self.initial(), self.span, self.cache, R, rows, exit=exits[0])[0]
        # requests with different exit rules: every step's state kept, each request's rows picked by its own rule
        net = self.net
        inj = net.prelude(self.ids(), self.span, self.cache)
        h = net.start_state(self.initial(), inj)
        states = []
        for r in range(1, R + 1):
            h = net.core_step(h, inj, self.span, self.cache, read=(r, r))
            states.append(h)
        parts = [list(self.split(s, dim=1)) for s in states]
        picked = [h_last if rule is None else rule.select([p[i] for p in parts], net.exit_logits)
                  for i, (rule, h_last) in enumerate(zip(exits, parts[-1]))]
        return net.readout(self._cat(picked), self.span, self.cache, rows)[0]
