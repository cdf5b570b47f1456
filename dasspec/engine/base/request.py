"""Request: the executor's state of one running request - its token buffer, its paged depth cache, its initial
states, its token choice and its statistics.  The scheduler's row for the same request (prompt, stop rule, blocks,
committed tokens) is ``core.scheduler.Entry``; drafters see neither, only a ``DraftContext`` (``drafting/context.py``).

Invariant between steps: the committed tokens are ``tokens[:L]`` with ``L = cache.n + 1``; the last committed
token (the *anchor*, at position ``n``) has been emitted but not yet materialised - the next target pass does
that.  Rows and token slots at or beyond ``L`` are scratch for drafts, checked against the rows its blocks back.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable

import torch
from torch import Tensor

from ...model import decode_kernel
from ...model.attention import Span
from ...model.cache import CacheCapacityError, PagedCache
from ...model.looped import LoopedLM
from .contract import Counts, StopReason
from .runtime import DEFAULT, Runtime

if TYPE_CHECKING:
    from ...model.exit import ExitRule

# (logits [W, V], positions: the first row's position or a tensor of every row's) -> chosen tokens [W]
TokenChoice = Callable[[Tensor, "int | Tensor"], Tensor]


def greedy(logits: Tensor, positions: "int | Tensor") -> Tensor:
    return decode_kernel.argmax(logits)


class DraftCapacityError(CacheCapacityError):
    """A draft needs more verifier rows than its drafter's declared ``width`` reserved."""


def rows_needed(block_size: int, prompt: int, max_new_tokens: int, width: int) -> int:
    """Cache rows one request can ever touch: its prompt and output, plus the scratch its drafter's widest draft
    writes past the last committed token (a verifier block of ``width`` inputs plus its last proposal)."""
    return min(prompt + max_new_tokens + width + 1, block_size + width + 1)


def pool_share(block_size: int, prompt: int, max_new_tokens: int, width: int, B: int) -> int:
    """Positions of a default pool kept for one request of blocks of B: its ``rows_needed`` in whole blocks (exact
    rows would leave its last ones short of a block, and preempt it near its end) and one block more, the headroom
    the scheduler keeps free per running request when it admits another (``Scheduler._admit``)."""
    return (-(-rows_needed(block_size, prompt, max_new_tokens, width) // B) + 1) * B


class Request:
    def __init__(self, model: LoopedLM, prompt: list[int], cache: PagedCache, *, R: int, max_rows: int,
                 max_new_tokens: int, width: int, init_scale: float = 1.0, state_seed: int = 0, runtime: Runtime = DEFAULT,
                 choose: TokenChoice = greedy, exit: "ExitRule | None" = None, deadline: float | None = None):
        self.model, self.R, self.width = model, R, width
        self.rid: int | None = None          # the engine's id
        self.P, self.prompt = len(prompt), prompt
        self.cache = cache
        self.runtime = runtime
        self.net = runtime.primitives(model)
        self.max_rows = max_rows
        self.tokens = torch.zeros(max_rows + 1, dtype=torch.long, device=model.device)
        self.tokens[: self.P] = torch.as_tensor(prompt, dtype=torch.long, device=model.device)
        self.init_scale, self.state_seed = init_scale, state_seed
        self._h0 = model.initial_state(torch.arange(0), init_scale, state_seed).unsqueeze(0)   # grown on demand
        self.choose = choose
        self.exit = exit                    # the target's exit rule (Ouro's early exit; None: the last step)
        self.generated: list[int] = []      # committed tokens (before the scheduler's stop rule)
        self.prefilled = 0                  # rows of the known tokens materialised by prefill
        self.depth_slice: tuple[int, Tensor, Tensor] | None = None   # (core steps done, state, injection) of a block
        self.max_new_tokens = max_new_tokens
        self.room = max_new_tokens          # tokens the next verification may commit (set by the executor per step)
        self.cap: int | None = None         # the step's draft cap (None: the drafter's own)
        self.closed = False                 # the step's StepPlan.closed (set by the executor)
        self.trace: list | None = None      # (Draft, Verdict) per block of this step, when asked for
        self.counts = Counts()              # what it spent this step (the executor reports it, then starts anew)
        self.deadline = deadline            # time.monotonic() past which it stops
        self.cancelled = False

    def stopping(self) -> StopReason | None:
        """Why it must stop now (cancelled, out of time), or None: asked between drafting rounds."""
        if self.cancelled:
            return StopReason.CANCELLED
        if self.deadline is not None and time.monotonic() > self.deadline:
            return StopReason.TIMEOUT
        return None

    # --- positions -----------------------------------------------------------------------------------
    @property
    def n(self) -> int:
        """Materialised (verified) rows; also the position of the anchor."""
        return self.cache.n

    @property
    def budget(self) -> int:
        """Tokens max_new_tokens still allows (before the stop rule)."""
        return self.max_new_tokens - len(self.generated)

    @property
    def depth_limit(self) -> int:
        """The deepest a draft node may lie below the anchor: its position must be inside the model context."""
        return self.model.config.block_size - 1 - self.n

    @property
    def static_shapes(self) -> bool:
        return self.runtime.static_shapes

    @property
    def device(self) -> torch.device:
        return self.tokens.device

    def draft_slots(self, w: int) -> Tensor:
        """The anchor's token slot followed by w scratch slots (``tokens[n : n + 1 + w]``)."""
        self.check_fits(w + 1, w + 1)
        return self.tokens[self.n: self.n + 1 + w]

    def scratch(self, w: int) -> Tensor:
        """The token slots of w proposals after the anchor (``tokens[n + 1 : n + 1 + w]``)."""
        self.check_fits(w + 1, w + 1)
        return self.tokens[self.n + 1: self.n + 1 + w]

    def check_fits(self, rows: int, slots: int) -> None:
        """A draft of ``rows`` verifier inputs and ``slots`` token slots (anchor included) must fit the rows the
        request's blocks back this step (the engine backs the drafter's declared ``width``)."""
        n = self.n
        if n + rows > self.cache.capacity or n + slots > self.max_rows + 1:
            raise DraftCapacityError(
                f"a draft of {max(rows, slots)} positions at row {n} does not fit the {self.cache.capacity} cache "
                f"rows backed this step (the drafter's width {self.width}); a drafter must declare a width that "
                "covers its drafts")

    def span(self, start: int, W: int, positions: Tensor | None = None, mask: Tensor | None = None) -> Span:
        """The model span for queries at rows [start, start+W) over the current verified prefix (the static-shape
        form when the runtime asks for it)."""
        if self.cache.rings:
            self.cache.check_ring(start + W)
        return self.model.span(self.cache.n, start, W, positions=positions, mask=mask,
                               static_capacity=self.cache.table.capacity if self.runtime.static_shapes else None)

    def initial(self, start: int, W: int, positions: Tensor | None = None) -> Tensor:
        """The target's initial states of rows [start, start + W) (or of ``positions``): [1, W, d]."""
        end = start + W if positions is None else int(positions.max()) + 1
        if end > self._h0.shape[1]:           # states are a pure function of position: extend, never recompute
            have = self._h0.shape[1]
            grow = max(end, min(2 * have, self.max_rows), 64)
            more = self.model.initial_state(torch.arange(have, grow), self.init_scale, self.state_seed)
            self._h0 = torch.cat((self._h0, more.unsqueeze(0)), dim=1)
        return self._h0[:, start: start + W] if positions is None else self._h0[:, positions]
