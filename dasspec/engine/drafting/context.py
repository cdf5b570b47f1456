"""DraftContext: what a drafting session may see of its request - the contract of ``draft.py`` enforced by code.

A session reads positions (``n``, ``P``), tokens (``prompt``, ``generated``: committed, the anchor last), the
step's budget (``room``: tokens the next verification may commit, the engine's draft cap included; ``cap``), whether
the batch is closed (``closed``), ``R``, ``config``, ``device``, ``depth_limit``, ``static_shapes``, the token choice
(``choose``) and ``stopping()``; it writes proposals into ``scratch(w)`` / ``draft_slots(w)`` and runs the model
only through ``Batch`` over contexts (``batch.py``: the three primitives on its scratch rows past ``n``), counting
what it ran with ``count``.
Nothing else of the request is reachable from here: the cache, the committed rows and the stop rule are not.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ..base.contract import Phase
from ..base.request import greedy

if TYPE_CHECKING:
    from ...model.config import LoopedConfig
    from ..base.request import Request, TokenChoice


class DraftContext:
    __slots__ = ("_req",)

    def __init__(self, req: "Request"):
        object.__setattr__(self, "_req", req)

    def __setattr__(self, name, value):
        raise AttributeError(f"a draft context is read-only (tried to set {name!r})")

    # --- what the session reads -----------------------------------------------------------------------------
    @property
    def n(self) -> int:
        return self._req.n

    @property
    def P(self) -> int:
        return self._req.P

    @property
    def prompt(self) -> list[int]:
        return self._req.prompt

    @property
    def generated(self) -> list[int]:
        return self._req.generated

    @property
    def R(self) -> int:
        return self._req.R

    @property
    def room(self) -> int:
        return self._req.room

    @property
    def budget(self) -> int:
        """Tokens max_new_tokens still allows (``room`` is this step's share of it)."""
        return self._req.budget

    @property
    def cap(self) -> int | None:
        return self._req.cap

    @property
    def closed(self) -> bool:
        """True in a closed batch (generate_batch) once no request waits for a slot or still prefills: the caller
        takes every result at once, so the batch is done when its last request is, and a request finishing early
        frees nothing anyone waits for (each request's ``budget`` bounds its remaining steps).  False in a server,
        where an early finish hands the slot on and every request's own latency counts."""
        return self._req.closed

    @property
    def depth_limit(self) -> int:
        return self._req.depth_limit

    @property
    def device(self) -> torch.device:
        return self._req.device

    @property
    def config(self) -> "LoopedConfig":
        return self._req.model.config

    @property
    def tokenizer(self):
        """The model's tokenizer (None when it has none): what a corpus file is read with."""
        return self._req.model.tokenizer

    @property
    def static_shapes(self) -> bool:
        return self._req.static_shapes

    @property
    def choose(self) -> "TokenChoice":
        return self._req.choose

    @property
    def greedy(self) -> bool:
        return self._req.choose is greedy

    def stopping(self) -> str | None:
        return self._req.stopping()

    # --- what the session writes and runs ---------------------------------------------------------------------
    def scratch(self, w: int) -> Tensor:
        return self._req.scratch(w)

    def draft_slots(self, w: int) -> Tensor:
        return self._req.draft_slots(w)

    def initial(self, start: int, W: int, positions: Tensor | None = None) -> Tensor:
        """The target's initial states of rows [start, start + W): where a draft row starts its recurrence."""
        return self._req.initial(start, W, positions)

    def start_state(self, h0: Tensor, inj: Tensor) -> Tensor:
        """What the first core step reads (the model family's hook)."""
        return self._req.net.start_state(h0, inj)

    def count(self, passes: int, updates: int) -> None:
        """Core passes and position-updates spent drafting."""
        self._req.counts.count(Phase.DRAFT, passes, updates)

    def count_choice(self, name: str) -> None:
        """A step drafted by ``name`` (method auto's choice, in ``stats.choices``)."""
        self._req.counts.choose(name)
